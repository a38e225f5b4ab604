"""``LedgerCallback``: a Lightning ``Callback`` that traces sampled optimizer steps.

One optimizer step in ``sample_every`` of a real ``Trainer.fit`` is traced with
``torchledger.Ledger``, from the ``on_train_batch_start`` of its first micro-batch to the
``on_train_batch_end`` after which the optimizer stepped (``trainer.global_step`` moved):
with ``accumulate_grad_batches=k`` all k micro-batches' forward and backward, ``zero_grad``
and the optimizer step are in the traced step. Lightning runs the last micro-batch's forward
and backward inside ``optimizer.step(closure)``; the tracer records them as forward and
backward all the same. Example::

    import lightning as L
    from torchledger.integrations.lightning import LedgerCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[LedgerCallback(sample_every=50)])
    trainer.fit(module, loader)
    # <trainer.log_dir>/torchledger/step_000001.json, step_000051.json, ..., report.txt
    # logged: torchledger/flops_per_token, torchledger/peak_bytes (and torchledger/mfu)

Tokens per step: ``numel()`` of each micro-batch's ``input_ids`` (a dict or attribute), of
the batch itself when it is an integer tensor, or of its first element when that is one
(``(x, y)``); summed over the step's micro-batches. Other batches: tokens unknown, said in the
record's warnings. The figures go to the trainer's loggers (``logger.log_metrics``) at the
step Lightning logs that optimizer step's own metrics at.

Works with ``lightning`` (``lightning.pytorch``) and with the older ``pytorch_lightning``
package (when it is the only one installed, or is imported before this module).

Known limitations: the learning-rate scheduler steps after ``on_train_batch_end``, outside
the traced step; files are written on global rank zero only (each process traces its own
steps).
"""
from __future__ import annotations

import sys


def _callback_bases() -> tuple:
    """``lightning.pytorch.Callback``, and ``pytorch_lightning.Callback`` when that package is
    the only one installed or was imported first: each ``Trainer`` checks for its own class."""
    bases = []
    try:
        from lightning.pytorch import Callback
        bases.append(Callback)
    except ImportError:
        pass
    if not bases or "pytorch_lightning" in sys.modules:
        try:
            from pytorch_lightning import Callback as LegacyCallback
            bases.append(LegacyCallback)
        except ImportError:
            pass
    if not bases:
        raise ImportError("torchledger.integrations.lightning needs lightning: pip install "
                          "'torchledger[integrations]' or pip install lightning")
    return tuple(bases)


from ._common import LedgerRun, RunView, guarded

__all__ = ["LedgerCallback"]

FRAMEWORK = "Lightning"


class LedgerCallback(RunView, *_callback_bases()):
    """Trace one optimizer step in ``sample_every`` of a Lightning ``fit``.

    ``keep``: records kept in memory (``callback.ledger.records``); ``peak_flops``: the
    device's peak FLOP/s, for MFU (None: no MFU); ``write``: write records and the report
    under ``<trainer.log_dir>/torchledger/`` (``default_root_dir`` without a logger);
    ``log``: send the headline figures to ``trainer.loggers``. Errors never reach training:
    they become one ``RuntimeWarning`` and the callback stops tracing.
    """

    def __init__(self, sample_every: int = 100, *, keep: int = 20, peak_flops=None,
                 write: bool = True, log: bool = True):
        self._run = LedgerRun(FRAMEWORK, sample_every=sample_every, keep=keep,
                              peak_flops=peak_flops, write=write, log=log)
        self._global_step = None         # trainer.global_step when the open step began

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        run = self._run
        if not run.is_open:              # the first micro-batch of an optimizer step
            optimizers = getattr(trainer, "optimizers", None) or [None]
            run.begin(pl_module, optimizers[0])
            self._global_step = trainer.global_step
            run.open(trainer.global_step + 1)    # numbered as steps completed after it
        run.add_micro_batch(batch)

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        run = self._run
        if not run.is_open or trainer.global_step == self._global_step:
            return                       # accumulating: the optimizer has not stepped yet
        figures = run.close(_out_dir(trainer), main=trainer.is_global_zero)
        if figures and run.log:
            # NB: straight to the loggers (as LearningRateMonitor does): a value given to
            # pl_module.log stays in Lightning's step results and is logged again at every
            # later step, untraced ones included
            step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped",
                           trainer.global_step - 1)
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=step)

    @guarded
    def on_train_end(self, trainer, pl_module):
        self._run.finish(_out_dir(trainer), main=trainer.is_global_zero)

    @guarded
    def on_exception(self, trainer, pl_module, exception):
        # NB: the step is closed so no hook outlives the run; not written (it is partial)
        self._run.close(None, main=False, note=f"partial step: training raised "
                                                 f"{type(exception).__name__}")

    def _remove_hook(self) -> None:
        """Nothing to remove: this callback installs no hook of its own (the tracer's go with
        the step)."""

    def close(self) -> None:
        """Close a step left open (no file written); ``on_exception`` already does."""
        self._run.close(None, main=False, note="partial step: closed by close()")


def _out_dir(trainer):
    """``trainer.log_dir`` (the logger's version directory), else ``default_root_dir``."""
    return getattr(trainer, "log_dir", None) or trainer.default_root_dir
