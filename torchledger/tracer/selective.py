"""Selective activation checkpointing: the outputs its policy keeps are activations.

``torch.utils.checkpoint.checkpoint(fn, context_fn=create_selective_checkpoint_contexts(policy))``
(torchtitan's default ``selective_ac_option="op"``) keeps the outputs of the ops its policy marks
``MUST_SAVE``/``PREFER_SAVE`` in its own storage until the recomputation takes them back, not
through saved-tensor hooks: inside the region the checkpoint's own hooks are the innermost and
keep nothing, so the tracer's hook never sees them. While a step is traced, the policy of each
selective-checkpoint forward mode is observed (``policy_fn`` wrapped for the op): an op it marks
saved has its outputs counted as saved for backward (``StepTracer.note_saved``), with the module
that ran it, exactly as autograd's saved tensors are (once per storage lifetime).

Known limitations: under ``torch.compile`` the mode saves every output whatever the policy says
(the traced step runs eager: not seen here); ``*_CPU_OFFLOAD`` policies are treated as PyTorch's
eager mode treats them today, as recomputed.
"""
from __future__ import annotations

__all__ = ["selective_checkpoint_hook", "saved_by_policy"]


def saved_by_policy(decision) -> bool:
    """Whether a selective-checkpoint policy's answer keeps the op's output, as
    ``_CachingTorchDispatchMode`` reads it: ``MUST_SAVE``/``PREFER_SAVE``, or ``True`` (the old
    boolean policies); anything else is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy
    if isinstance(decision, bool):
        return decision
    return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def selective_checkpoint_hook(note_saved, life, ours):
    """Patch the selective-checkpoint forward mode's ``__torch_dispatch__`` (through ``life``,
    undone with the step) so that the outputs of each op its policy keeps go to
    ``note_saved(tensor)``. Calls on threads that are not the step's (``ours()`` false) go
    straight through. Returns None, or a warning when this torch has selective checkpointing
    but not the mode the patch expects (its saved outputs would then go uncounted)."""
    from torch.utils import checkpoint as ckpt
    if not hasattr(ckpt, "create_selective_checkpoint_contexts"):
        return None                                       # nothing to observe
    mode_class = getattr(ckpt, "_CachingTorchDispatchMode", None)    # torch-version private
    if mode_class is None or not hasattr(mode_class, "__torch_dispatch__"):
        return ("selective activation checkpointing: this torch has no _CachingTorchDispatchMode, "
                "so the outputs a policy saves are not counted as activations (activation and peak "
                "bytes of such a step are a lower bound)")
    from torch.utils._pytree import tree_leaves
    original = mode_class.__torch_dispatch__
    import torch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        policy = vars(self).get("policy_fn")
        if policy is None or not ours():
            return original(self, func, types, args, kwargs)
        decided = []

        def observed(ctx, op, *a, **k):
            decision = policy(ctx, op, *a, **k)
            decided.append(decision)
            return decision
        self.policy_fn = observed
        try:
            out = original(self, func, types, args, kwargs)
        finally:
            self.policy_fn = policy
        if decided and saved_by_policy(decided[-1]):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    note_saved(t)
        return out

    life.patch(mode_class, "__torch_dispatch__", __torch_dispatch__)
    return None
