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
* An exception that escapes ``trainer.train()`` in the middle of a traced step (Ctrl-C, an
  error in the model, HF's "batch received was empty") closes that step as it passes: the
  callback wraps the trainer's ``train`` (an instance attribute set at ``on_init_end``, which
  only calls the class's own ``train``). The step's record stays in ``callback.ledger.records``
  marked failed (``meta.failed``, a warning saying why); no file is written for it. Added with
  ``trainer.add_callback()`` after the Trainer was made, the callback wraps
  ``trainer.training_step`` for that first ``train()`` instead (forward and backward); an
  exception elsewhere in the step (the optimizer step, another callback) leaves it open until
  the next callback event, the Trainer's garbage collection or interpreter exit, whichever
  comes first (``callback.close()`` closes it at once).
"""
from __future__ import annotations

import functools
import sys
import weakref

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
        self._trainer = None             # weakref to the Trainer whose train() is guarded
        self._guarding = 0               # train() calls running inside the guard now
        self._step_wrapped = None        # the Trainer whose training_step is wrapped (see on_train_begin)

    @guarded
    def on_init_end(self, args, state, control, **kwargs):
        self._attach(_find_trainer(self))

    @guarded
    def on_train_begin(self, args, state, control, **kwargs):
        if self._run.is_open:       # left open by an exception out of an earlier train()
            self._abandon("partial step: closed when the next train() began (an exception ended the "
                          "previous one mid-step)")
        trainer = self._attach(_find_trainer(self))
        if trainer is not None and not self._guarding:
            # added with add_callback() after __init__: this train() call started unguarded
            self._wrap_training_step(trainer)

    @guarded
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        run = self._run
        if run.is_open:              # a step never closed (should not happen): close it first
            self._close(args, state, note="partial step: a new step began before it ended")
        run.begin(model, optimizer)
        run.open(state.global_step + 1)   # numbered as the Trainer's logs number it
        if run.tracing:
            run.hold(model.register_forward_pre_hook(self._count_tokens, with_kwargs=True))

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
        self._unwrap_training_step()
        self._run.finish(args.output_dir, main=state.is_world_process_zero)

    def close(self) -> None:
        """Close a step left open by an exception out of ``trainer.train()`` (no file written)."""
        self._unwrap_training_step()
        self._run.close(None, main=False, note="partial step: closed by close()")

    def _close(self, args, state, note=None):
        return self._run.close(args.output_dir, main=state.is_world_process_zero, note=note)

    def _remove_hook(self) -> None:
        self._run.release_hooks()

    def _abandon(self, note: str, error: BaseException | None = None) -> None:
        """Close an open step that will not end (never raises; see ``LedgerRun.abandon``)."""
        try:
            self._unwrap_training_step()
        finally:
            self._run.abandon(note, error)

    # -- guarding train() -------------------------------------------------------------------
    def _attach(self, trainer):
        """Guard ``trainer.train`` (an exception out of it closes the open step) and close the
        open step when the trainer is collected. Once per trainer; returns the trainer."""
        if trainer is None or (self._trainer is not None and self._trainer() is trainer):
            return trainer
        self._trainer = weakref.ref(trainer)
        trainer.train = _guarded_train(trainer, weakref.ref(self))
        weakref.finalize(trainer, self._run.abandon, "partial step: the Trainer was garbage-collected "
                                                     "with this optimizer step open")
        return trainer

    def _guard(self, call):
        """Run ``call()`` (a ``train()``) so that an exception out of it closes the open step."""
        self._guarding += 1
        try:
            return call()
        except BaseException as e:
            if self._run.is_open:
                self._abandon(f"partial step: trainer.train() raised {type(e).__name__} in the middle "
                              f"of this optimizer step", e)
            raise
        finally:
            self._guarding -= 1

    def _wrap_training_step(self, trainer) -> None:
        """For one ``train()`` that began unguarded: an exception out of a micro-batch's
        ``training_step`` closes the open step (until ``on_train_end``)."""
        if self._step_wrapped is not None:
            return
        previous = trainer.__dict__.get("training_step")
        method = type(trainer).training_step
        me, owner = weakref.ref(self), weakref.ref(trainer)     # no reference to either kept

        @functools.wraps(method)
        def training_step(*args, **kwargs):
            try:
                return previous(*args, **kwargs) if previous is not None else method(owner(), *args, **kwargs)
            except BaseException as e:
                cb = me()
                if cb is not None and cb._run.is_open:
                    cb._abandon(f"partial step: training_step raised {type(e).__name__} in the middle "
                                f"of this optimizer step", e)
                raise

        trainer.training_step = training_step
        self._step_wrapped = (weakref.ref(trainer), training_step)

    def _unwrap_training_step(self) -> None:
        wrapped, self._step_wrapped = self._step_wrapped, None
        if wrapped is None:
            return
        trainer = wrapped[0]()
        if trainer is not None and trainer.__dict__.get("training_step") is wrapped[1]:
            del trainer.training_step


def _find_trainer(callback):
    """The ``Trainer`` whose callback handler holds ``callback``, found on the call stack
    (callbacks are not handed the trainer); None when none is."""
    from transformers import Trainer
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            handler = getattr(owner, "callback_handler", None)
            if any(c is callback for c in getattr(handler, "callbacks", ())):
                return owner
        frame = frame.f_back
    return None


def _guarded_train(trainer, callback_ref):
    """``trainer.train`` run inside the callback's guard. Holds the trainer and the callback
    weakly (no cycle through the instance attribute); calls what ``train`` was before (an
    instance attribute someone else set, else the class's method)."""
    previous = trainer.__dict__.get("train")
    method = type(trainer).train
    owner = weakref.ref(trainer)

    @functools.wraps(method)
    def train(*args, **kwargs):
        def call():
            return previous(*args, **kwargs) if previous is not None else method(owner(), *args, **kwargs)
        cb = callback_ref()
        return call() if cb is None else cb._guard(call)
    return train


def _grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()


def _logger():
    from transformers.utils import logging
    return logging.get_logger(__name__)
