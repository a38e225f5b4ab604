"""``LedgerCallback``: a ``transformers.TrainerCallback`` that traces sampled optimizer steps.

One optimizer step in ``sample_every`` of a real ``Trainer`` run is traced with
``torchledger.Ledger``, from ``on_step_begin`` (before the first micro-batch of the
gradient-accumulation window) to ``on_step_end`` (after gradient clipping, the optimizer
step, the scheduler step and ``zero_grad``): every micro-batch's forward and backward are in
the traced step, whatever ``gradient_accumulation_steps``, ``bf16``, ``gradient_checkpointing``
or frozen (PEFT-style) parameters the run uses. Example::

    from transformers import Trainer, TrainingArguments
    from torchledger.integrations.hf import LedgerCallback

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", ...),
                      train_dataset=ds, callbacks=[LedgerCallback(sample_every=50)])
    trainer.train()
    # out/torchledger/step_000001.json, step_000051.json, ... and out/torchledger/report.txt
    # trainer.state.log_history has {"torchledger/flops_per_token": ..., "step": 1}, ...

Tokens per step: the ``input_ids`` (the model's ``main_input_name``) given to the model's
forward, ``numel()`` summed over the step's micro-batches (padding included); a forward
pre-hook on the model counts them while a traced step is open, and is removed with it.

Known limitations:

* The figures go to ``trainer.state.log_history`` (and so ``trainer_state.json`` in
  checkpoints) and to the ``transformers`` logger; reporting integrations (``report_to``)
  receive the Trainer's own ``on_log`` dicts only, which a callback cannot add to.
* Files are written on the main process only (``state.is_world_process_zero``); each
  process traces its own steps.
* An exception that escapes ``trainer.train()`` in the middle of a traced step (Ctrl-C)
  leaves that step's tracer installed: call ``callback.close()`` (e.g. in ``finally``).
"""
from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("torchledger.integrations.hf needs transformers (and accelerate, which "
                      "Trainer uses): pip install 'torchledger[integrations]' "
                      "or pip install transformers accelerate") from e

from ._common import LedgerRun, RunView, guarded

__all__ = ["LedgerCallback"]

FRAMEWORK = "Hugging Face Trainer"


class LedgerCallback(RunView, TrainerCallback):
    """Trace one optimizer step in ``sample_every`` of a ``Trainer`` run.

    ``keep``: records kept in memory (``callback.ledger.records``); ``peak_flops``: the
    device's peak FLOP/s, for MFU (None: no MFU); ``write``: write records and the report
    under ``<output_dir>/torchledger/``; ``log``: add the headline figures to
    ``trainer.state.log_history``. Errors never reach training: they become one
    ``RuntimeWarning`` and the callback stops tracing.
    """

    def __init__(self, sample_every: int = 100, *, keep: int = 20, peak_flops=None,
                 write: bool = True, log: bool = True):
        self._run = LedgerRun(FRAMEWORK, sample_every=sample_every, keep=keep,
                              peak_flops=peak_flops, write=write, log=log)
        self._token_hook = None

    @guarded
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        run = self._run
        if run.is_open:              # a step never closed (should not happen): close it first
            self._close(args, state, note="partial step: a new step began before it ended")
        run.begin(model, optimizer)
        run.open(state.global_step + 1)   # numbered as the Trainer's logs number it
        if run.tracing:
            self._token_hook = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)

    def _count_tokens(self, module, args, kwargs):
        try:
            if not (module.training and _grad_enabled()):
                return
            key = getattr(module, "main_input_name", None) or "input_ids"
            x = kwargs.get(key, args[0] if args else None)
            self._run.add_micro_batch({key: x} if x is not None else kwargs, key=key)
        except Exception as e:  # noqa: BLE001 (a hook must never kill training)
            self._run.token_error(e)

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        figures = self._close(args, state)
        if figures and self._run.log:
            state.log_history.append({**figures, "step": state.global_step})
            _logger().info("torchledger step %d: %s", state.global_step,
                           ", ".join(f"{k.split('/')[-1]}={v:.6g}" for k, v in figures.items()))

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()
        self._run.finish(args.output_dir, main=state.is_world_process_zero)

    def close(self) -> None:
        """Close a step left open by an exception out of ``trainer.train()`` (no file written)."""
        self._remove_hook()
        self._run.close(None, main=False, note="partial step: closed by close()")

    def _close(self, args, state, note=None):
        self._remove_hook()
        return self._run.close(args.output_dir, main=state.is_world_process_zero, note=note)

    def _remove_hook(self) -> None:
        hook, self._token_hook = self._token_hook, None
        if hook is not None:
            hook.remove()


def _grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()


def _logger():
    from transformers.utils import logging
    return logging.get_logger(__name__)
