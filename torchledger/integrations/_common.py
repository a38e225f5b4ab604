"""What the framework callbacks share: a ``Ledger`` over the run, one step open at a time.

A framework tells its callbacks where an optimizer step begins and ends (Hugging Face:
``on_step_begin`` / ``on_step_end``; Lightning: the first ``on_train_batch_start`` of an
accumulation window / the ``on_train_batch_end`` after which the optimizer stepped).
``LedgerRun`` enters ``Ledger.step()`` at the first and exits it at the second, so a traced
step holds every micro-batch's forward and backward, gradient clipping, the optimizer step
and ``zero_grad``. Tokens are added per micro-batch while the step is open.

Nothing here may raise into training: the callbacks call ``guarded`` methods, and an error
turns into one warning, closes the open step (no hook stays installed) and disables the
callback for the rest of the run.

A step whose end never comes (an exception out of the framework's loop mid-step) is
``abandon``-ed: by the framework callback's own guard around the loop, at its next callback
event, when its trainer is collected, or at interpreter exit (``_OPEN``, closed by ``atexit``),
whichever comes first.
"""
from __future__ import annotations

import atexit
import functools
import os
import warnings
from collections.abc import Mapping

__all__ = ["LedgerRun", "RunView", "guarded", "batch_tokens", "RECORDS_DIR", "REPORT_NAME"]

#: Subdirectory of the run's output directory that gets the records and the report.
RECORDS_DIR = "torchledger"
REPORT_NAME = "report.txt"


class RunView:
    """What a callback shows of its ``LedgerRun`` (``self._run``)."""

    @property
    def ledger(self):
        """The ``torchledger.Ledger`` of the run (None before the first step)."""
        return self._run.ledger

    @property
    def written(self) -> list:
        """Paths of the files written so far."""
        return list(self._run.written)


class LedgerRun:
    """The state of one callback: its ``Ledger`` (made at the first step) and the open step."""

    def __init__(self, framework: str, *, sample_every: int = 100, keep: int = 20,
                 peak_flops=None, write: bool = True, log: bool = True):
        if not isinstance(sample_every, int) or isinstance(sample_every, bool) or sample_every < 1:
            raise ValueError(f"sample_every must be an int >= 1 (one optimizer step in "
                             f"sample_every is traced), got {sample_every!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (traced step records kept in memory), got {keep!r}")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not peak_flops > 0):
            raise ValueError(f"peak_flops must be a positive number (the device's peak FLOP/s, for MFU), "
                             f"got {peak_flops!r}")
        self.framework = framework
        self.sample_every, self.keep, self.peak_flops = sample_every, keep, peak_flops
        self.write, self.log = write, log
        self.ledger = None
        self.disabled = False
        self.written: list = []          # paths of the files written, in order
        self.figures: dict = {}          # headline figures of the last traced step
        self._step = None                # (context manager, tracer or None, label)
        self._tokens = 0
        self._micro_batches = 0
        self._token_where = None         # how tokens were counted; None when any was unknown
        self._token_missing = None       # why tokens are unknown, once one micro-batch had none
        self._hooks: list = []           # the callback's own handles, removed with the step

    # -- the step ------------------------------------------------------------------------
    def begin(self, model, optimizer) -> None:
        """Make the ledger for ``model`` and the framework's optimizer (wrappers unwrapped);
        a new one when either changed (a second ``fit``/``train`` with the same callback)."""
        optimizer = unwrap_optimizer(optimizer)
        ledger = self.ledger
        if ledger is None or ledger.model is not model or ledger.optimizer is not optimizer:
            import torchledger              # the public name (its module moves in issue 13)
            self.ledger = torchledger.Ledger(model, optimizer=optimizer, sample_every=self.sample_every,
                                             keep=self.keep, peak_flops=self.peak_flops)

    @property
    def is_open(self) -> bool:
        return self._step is not None

    @property
    def tracing(self) -> bool:
        """The open step is a traced one (not just timed)."""
        return self._step is not None and self._step[1] is not None

    def open(self, label: int) -> None:
        """Enter ``Ledger.step()``: the step numbered ``label`` (the framework's global step).
        The ledger counts steps as the framework does (``meta.step_index`` is ``label - 1``
        and ``sample_every`` samples global steps), so a run resumed from a checkpoint goes
        on numbering where the first left off."""
        if isinstance(label, int) and label >= 1:
            self.ledger.steps = label - 1
        cm = self.ledger.step()
        tracer = cm.__enter__()
        self._step = (cm, tracer, label)
        _OPEN.add(self)                  # closed at interpreter exit if nothing closes it first
        self._tokens, self._micro_batches = 0, 0
        self._token_where, self._token_missing = None, None

    def hold(self, handle) -> None:
        """Keep a hook ``handle`` of the callback's (``.remove()``) to remove with the step."""
        self._hooks.append(handle)

    def release_hooks(self) -> None:
        """Remove the handles given to ``hold`` (each once, even if one removal raises)."""
        hooks, self._hooks = self._hooks, []
        errors = []
        for handle in hooks:
            try:
                handle.remove()
            except Exception as e:  # noqa: BLE001 (the others are removed all the same)
                errors.append(e)
        if errors:
            raise errors[0]

    def add_micro_batch(self, batch, key: str = "input_ids") -> None:
        """Count the tokens of one micro-batch of the open step (``batch_tokens``)."""
        if not self.tracing:
            return
        n, where = batch_tokens(batch, key)
        self._micro_batches += 1
        if n is None:
            self._token_missing = self._token_missing or where
        else:
            self._tokens += n
            self._token_where = where

    def token_error(self, error: Exception) -> None:
        """Counting a micro-batch's tokens failed: the step's tokens are unknown."""
        self._token_missing = self._token_missing or f"counting them raised {type(error).__name__}: {error}"

    def close(self, out_dir, *, main: bool = True, note: str | None = None):
        """Exit the open step; for a traced one write its record (``main`` process only) and
        return its headline figures (None for an untraced step or none open)."""
        if self._step is None:
            return None
        cm, tracer, label = self._step
        try:
            if tracer is not None:
                tokens, source = self._tokens_of_step()
                if tokens:
                    tracer.tokens, tracer.tokens_source = tokens, source
        finally:
            self._step = None
            _OPEN.discard(self)
            try:
                self.release_hooks()
            finally:
                cm.__exit__(None, None, None)    # the tracer's hooks are removed here, whatever happened
        record = tracer.record if tracer is not None else None
        if record is None:
            return None
        if note:
            record.warnings.append(note)
        if not record.totals.get("tokens"):
            why = self._token_missing or "no micro-batch with token ids reached the model"
            record.warnings.append(f"tokens unknown: {why}")
        if self.write and main and out_dir:
            self._write(out_dir, f"step_{label:06d}.json", record.to_json())
        self.figures = headline(record)
        return self.figures

    def _tokens_of_step(self):
        if self._token_missing or not self._tokens:
            return None, None
        k = self._micro_batches
        return self._tokens, (f"{self._token_where} summed over {k} micro-batch{'es' if k != 1 else ''} "
                              f"({self.framework})")

    def finish(self, out_dir, *, main: bool = True) -> None:
        """At the end of training: close a step left open (its record says it is partial) and
        write the report of the last traced step. Nothing stays installed after this."""
        self.close(out_dir, main=main, note="partial step: training ended before this optimizer "
                                            "step completed")
        if self.write and main and out_dir and self.ledger is not None and self.ledger.records:
            self._write(out_dir, REPORT_NAME, self.ledger.report() + "\n")

    def abandon(self, note: str, error: BaseException | None = None) -> None:
        """Close a step whose end will never come (``error`` escaped the framework's loop in
        the middle of it, or its trainer is gone): every hook is removed, the record is kept in
        ``ledger.records`` marked failed (``meta.failed``) with ``note`` in its warnings, and no
        file is written. Never raises: it runs while the user's exception propagates; a failure
        to close becomes one ``RuntimeWarning``. Nothing happens when no step is open."""
        step, self._step = self._step, None
        _OPEN.discard(self)
        if step is None:
            return
        cm, tracer, _ = step
        try:
            try:
                self.release_hooks()
            finally:
                if error is None:
                    cm.__exit__(None, None, None)
                else:       # the record says the step failed; the same exception comes back out
                    cm.__exit__(type(error), error, error.__traceback__)
        except BaseException as e:  # noqa: BLE001 (the user's exception is the one to see)
            if e is not error:
                warnings.warn(f"torchledger {self.framework} callback: closing a step left open ({note}) "
                              f"raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        record = tracer.record if tracer is not None else None
        if record is not None:
            record.warnings.append(note)

    def disable(self, where: str, error: BaseException) -> None:
        """Turn an error into a warning: close the open step, trace nothing more this run."""
        self.disabled = True
        try:
            if self._step is not None:
                (cm, _, _), self._step = self._step, None
                _OPEN.discard(self)
                try:
                    self.release_hooks()
                finally:
                    cm.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001 (the warning below names the first error)
            error = f"{type(error).__name__}: {error}; closing the step then raised {type(e).__name__}: {e}"
        else:
            error = f"{type(error).__name__}: {error}"
        warnings.warn(f"torchledger {self.framework} callback disabled: {where} raised {error}. "
                      f"Training goes on untraced; records written so far are kept. Please report "
                      f"this with the model and framework versions.", RuntimeWarning, stacklevel=3)

    def _write(self, out_dir, name: str, text: str) -> None:
        from ..render.output import write_atomic  # lazy: the callback's module loads with the user's trainer
        directory = os.path.join(os.fspath(out_dir), RECORDS_DIR)
        os.makedirs(directory, exist_ok=True)
        path = self._free_path(directory, name)
        write_atomic(path, text)
        self.written.append(path)

    def _free_path(self, directory: str, name: str) -> str:
        """``directory/name``, unless an earlier run left a step record there (a run resumed
        from a checkpoint redoes its steps): then ``step_000003.1.json``, ``.2``, ... so that
        no run's records are overwritten. The report and this run's own files are replaced."""
        path = os.path.join(directory, name)
        if name == REPORT_NAME or path in self.written or not os.path.exists(path):
            return path
        stem, ext = os.path.splitext(name)
        n = 1
        while True:
            candidate = os.path.join(directory, f"{stem}.{n}{ext}")
            if candidate in self.written or not os.path.exists(candidate):
                return candidate
            n += 1


#: Runs with a step open: closed at interpreter exit if nothing closed them before.
_OPEN: set = set()


@atexit.register
def _close_at_exit() -> None:
    for run in list(_OPEN):
        run.abandon("partial step: the interpreter exited before this optimizer step ended")


def guarded(method):
    """A callback method that never raises into training: an error removes the callback's own
    hooks (its ``_remove_hook()``), disables it (``LedgerRun.disable``: the open step is
    closed) and the method returns None. A disabled callback does nothing."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        state = self._run
        if state.disabled:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 (never into the user's training)
            try:
                self._remove_hook()         # the callback's own hooks, if it has any
            except Exception:  # noqa: BLE001 (disable() below still warns and closes the step)
                pass
            state.disable(f"{type(self).__name__}.{method.__name__}", e)
        return None
    return run


def headline(record) -> dict:
    """The figures logged to the framework: matmul FLOPs of the step (and per token when the
    tokens are known), the peak bytes, and MFU when a peak FLOP/s was given."""
    t = record.totals
    flops = t["flops"]["total"]
    out = {"torchledger/flops": float(flops), "torchledger/peak_bytes": float(t["peak_bytes"])}
    if t.get("tokens"):
        out["torchledger/tokens"] = float(t["tokens"])
        out["torchledger/flops_per_token"] = flops / t["tokens"]
    if t.get("mfu") is not None:
        out["torchledger/mfu"] = float(t["mfu"])
    return out


def batch_tokens(batch, key: str = "input_ids"):
    """``(tokens, where)`` of one micro-batch: ``batch[key].numel()`` for a mapping (or an
    object with that attribute), ``numel()`` of an integer tensor, or of the first element of
    a tuple/list when it is one. ``(None, why)`` otherwise (float inputs are not tokens)."""
    import torch
    if isinstance(batch, Mapping) or hasattr(batch, "keys"):
        try:
            x = batch[key] if key in batch else None
        except Exception:  # noqa: BLE001 (a mapping-like object that is not one)
            x = None
        if isinstance(x, torch.Tensor):
            return x.numel(), f"{key}.numel()"
        return None, f"the batch has no tensor {key!r}"
    if isinstance(getattr(batch, key, None), torch.Tensor):
        return getattr(batch, key).numel(), f"batch.{key}.numel()"
    if isinstance(batch, torch.Tensor):
        if _is_int(batch):
            return batch.numel(), "batch.numel()"
        return None, f"the batch is a {batch.dtype} tensor, not token ids"
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        if _is_int(batch[0]):
            return batch[0].numel(), "batch[0].numel()"
        return None, f"batch[0] is a {batch[0].dtype} tensor, not token ids"
    return None, f"no token ids found in a batch of type {type(batch).__name__}"


def _is_int(t) -> bool:
    import torch
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``,
    itself a ``torch.optim.Optimizer`` subclass sharing the inner one's state; Lightning's
    ``LightningOptimizer``), or None. NB: tracing the wrapper would count that state twice."""
    import torch
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer
