"""The phases every traced op belongs to, in the record's order (a leaf: the dispatch mode, the
segment and shape logs and the record builder all index by them)."""

__all__ = ["PHASES", "FORWARD", "BACKWARD", "RECOMPUTE", "OPTIMIZER", "OTHER"]

#: "other": ops outside the model's forward, its backward and ``optimizer.step()`` that build
#: no autograd graph (gradient clipping, grad-norm logging, data preparation, a metric under
#: no_grad): counted apart, in no model total.
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER, OTHER = range(5)
