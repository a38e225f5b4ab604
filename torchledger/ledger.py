"""The public API: ``trace()`` one step and ``Ledger`` for a whole loop. Each composes the
pipeline: the tracer records the step (:mod:`torchledger.tracer`), the analyzers judge the
record (predictions, comparisons, allocator summary, findings: :mod:`torchledger.analyzers`)
and the renderers print it (:mod:`torchledger.render`).

    import torchledger
    with torchledger.trace(model, optimizer=opt, tokens=B * T) as t:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    t.record.totals["flops"]        # forward / backward / optimizer / total
    print(t.report())

    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=100)
    for x, y in loader:
        with ledger.step(tokens=x.numel()):
            ...

Works on CPU, CUDA, meta and fake tensors. One tracer may be active at a time.
"""
from __future__ import annotations

import os
import time
import warnings
from collections import deque
from contextlib import contextmanager

from .analyzers.compare import record_predictions
from .analyzers.mfu import mfu_totals
from .analyzers.snapshot import allocator_view
from .tracer.compiled import note_run
from .tracer.ranks import mesh_shape
from .tracer.step import StepTracer, check_optimizer
from .analyzers.checks import run_checks
from .render.table import render_table

__all__ = ["trace", "Ledger", "LEAK_WINDOW"]


def judge(tracer) -> None:
    """Complete a finished tracer's record with what the judging layer computes from it: the
    closed-form predictions and comparisons, the allocator snapshot read (CUDA) and what the
    run noted (``meta.compiled``, ``meta.autocast``). Never raises into the user's step."""
    rec = tracer.record
    if rec is None:
        return
    try:
        note_run(tracer)
        alloc = rec.memory.get("allocator")
        if isinstance(alloc, dict):
            rec.memory["allocator"] = allocator_view(alloc, getattr(tracer, "snapshot", None),
                                                     getattr(tracer, "snapshot_marks", None),
                                                     getattr(tracer, "snapshot_device", None))
        rec.predictions = record_predictions(rec)
    except Exception as e:  # noqa: BLE001
        rec.warnings.append(f"record incomplete: {type(e).__name__}: {e}")


class _Traced(StepTracer):
    """What ``trace()`` returns: a ``StepTracer`` with the report and findings at hand."""

    def report(self, **options) -> str:
        if self.record is None:
            raise RuntimeError("report() is available after the traced block ends")
        return render_table(self.record, self.findings(), **options)

    def _finished(self) -> None:
        # NB: not an __exit__ override calling super(): a Ctrl-C at that call would skip
        # StepTracer.__exit__ and leave every hook installed
        judge(self)                     # predictions, allocator summary, meta.compiled
        _keep_findings(self.record, self.findings)

    def findings(self, **options) -> list:
        """Findings of every analyzer; ``options`` as in ``[tool.torchledger]`` (and
        ``peak_flops`` for MFU, defaulting to the one given to ``trace``). The record keeps
        the last ones computed (``record.findings``, in ``to_dict()``), so a saved record
        renders them offline."""
        if self.record is None:
            raise RuntimeError("findings() are available after the traced block ends")
        options.setdefault("peak_flops", self.peak_flops)
        found = run_checks([self.record], options)
        self.record.findings = list(found)
        self.record.totals.update(mfu_totals([self.record], options))   # the report's one MFU
        return found


def _keep_findings(record, compute) -> None:
    """Store the default findings in a finished record; an analyzer error must not turn the
    end of the user's step into an exception (the record notes it instead)."""
    if record is None:
        return
    try:
        compute()
    except Exception as e:  # noqa: BLE001
        record.warnings.append(f"findings unavailable: {type(e).__name__}: {e}")


def trace(model, optimizer=None, tokens=None, *, seq_len=None, peak_flops=None,
          clock=time.perf_counter, tokens_source=None, mesh=None) -> _Traced:
    """Trace one training step of ``model``; use as ``with trace(model, opt, tokens=N) as t``.

    ``tokens`` (tokens per step, for 6ND) and ``seq_len`` (for the attention term) are
    optional; without ``seq_len`` T is read off the model's first call as ``audit`` reads its
    inputs (the last dim of 2-D integer token ids, ``meta.seq_len_source``). ``peak_flops``
    (FLOP/s) enables MFU. ``tokens_source`` says how ``tokens`` was obtained, for reports (``totals.tokens_source``; default "given"). ``mesh`` (a
    ``DeviceMesh`` or a shape) names the run's mesh in ``totals.mesh``; without it the mesh
    of the model's DTensor parameters, else ``[world_size]`` under torch.distributed.
    """
    traced = _Traced(model, optimizer=optimizer, tokens=tokens, peak_flops=peak_flops, clock=clock,
                     seq_len=seq_len, tokens_source=tokens_source)
    traced.mesh = mesh_shape(mesh)      # a bad mesh= is refused here, before the step
    return traced


#: Traced steps the leak rules compare (the new one and those before it): TL-LEAK-001 needs
#: growth over three steps after the window's first, TL-LEAK-003 two consecutive steps.
LEAK_WINDOW = 8
#: Untraced step times kept (their median is the step time MFU uses).
TIMES_KEPT = 1000


class Ledger:
    """Trace many steps of an existing loop; one in ``sample_every`` is traced.

    ``with ledger.step(tokens=n): ...`` around each step. Untraced steps cost a counter and
    two clock reads. A long run costs no more memory than a short one:

    * ``records``: the ``StepRecord`` of the last ``keep`` traced steps (default 20; a
      record of a small model is about 0.3 MB); older records are dropped.
    * the leak window: the records of the last ``LEAK_WINDOW`` (8) traced steps, kept
      whatever ``keep`` is; between traced steps, weak references to the storages the last
      one left alive (to see them still alive at the next). No tensor is held.
    * ``untraced_seconds``: the last ``TIMES_KEPT`` (1,000) untraced step times.

    Findings: at the end of each traced step every analyzer runs once over the leak window
    (the leak rules compare its steps, the others read the new record) and the new record
    keeps the result (``record.findings``); the cost does not grow with the run.
    ``findings()`` runs them over the same window: it describes the recent steps, and a
    finding that stopped holding stays only in the records of the steps it held in.

    Example::

        ledger = Ledger(model, optimizer=opt, sample_every=100, keep=10)
        for x, y in loader:
            with ledger.step(tokens=x.numel()):
                loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
        print(ledger.report())

    ``save_to``: a path where each traced step's record is saved as the step ends (as
    ``StepRecord.save``: under torchrun ``{rank}``, a folder or a ``.rank{r}`` suffix keep the
    ranks' files apart; ``{step}`` becomes the step's index). Under torchrun a rank that fails
    takes the others down in the next collective, before any save after the loop: with
    ``save_to`` each rank's file holds its last completed traced step (a step that raised
    does not overwrite it). A write that fails is a ``RuntimeWarning``, never an error in the
    loop; ``save_to`` must name a file (a FIFO or device is such a warning: a FIFO with no
    reader would block the step).

    Known limitations: with ``sample_every > 1`` traced steps are not consecutive, so
    TL-LEAK-003 (gradients never cleared) needs ``sample_every=1``; growth slower than
    ``LEAK_WINDOW`` traced steps is judged on the window only.
    """

    def __init__(self, model, optimizer=None, *, sample_every: int = 1, keep: int = 20,
                 peak_flops=None, clock=time.perf_counter, mesh=None, save_to=None):
        if not isinstance(sample_every, int) or isinstance(sample_every, bool) or sample_every < 1:
            raise ValueError(f"sample_every must be an int >= 1, got {sample_every!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (traced step records kept), got {keep!r}")
        check_optimizer(optimizer, "Ledger()")
        self.model, self.optimizer = model, optimizer
        self.mesh = mesh_shape(mesh)        # totals.mesh (tracer/ranks.py)
        self.sample_every, self.peak_flops, self.clock = sample_every, peak_flops, clock
        self.keep = keep
        self.save_to = None if save_to is None else os.fspath(save_to)
        self.saved: list = []       # paths save_to wrote, in order (a path once)
        self.records: list = []
        self.steps = 0
        self._window: deque = deque(maxlen=LEAK_WINDOW)
        self._carry: dict = {}      # weakrefs to storages kept by the last traced step (leak analysis)
        self.snapshot = None        # CUDA: the allocator snapshot of the last traced step
        self.untraced_seconds: list = []   # wall time of the last TIMES_KEPT untraced steps
        self._cuda = None

    @contextmanager
    def step(self, tokens=None, seq_len=None, *, tokens_source=None):
        """Trace (or time) one step; ``tokens`` per step for 6ND, ``tokens_source`` how it was
        obtained (``totals.tokens_source``; default "given")."""
        i = self.steps
        self.steps += 1
        if i % self.sample_every:
            t0 = self._edge()
            yield None
            self._note_untraced(self._edge() - t0)
            return
        tracer = StepTracer(self.model, optimizer=self.optimizer, tokens=tokens,
                            peak_flops=self.peak_flops, clock=self.clock, step_index=i,
                            seq_len=seq_len, carry=self._carry, tokens_source=tokens_source)
        tracer.mesh = self.mesh
        completed = False
        try:
            with tracer:
                yield tracer
            completed = True
        finally:
            if tracer.record is not None:
                judge(tracer)           # predictions, allocator summary, meta.compiled
                self._keep(tracer.record)
                self._carry = tracer.carry_out
                self.snapshot = getattr(tracer, "snapshot", None)
                _keep_findings(tracer.record, self.findings)
                if completed and self.save_to is not None:
                    self._save_step(tracer.record, i)

    def _save_step(self, record, index: int) -> None:
        """``save_to``: write the step's record now (a rank killed later keeps it)."""
        path = self.save_to.replace("{step}", str(index))
        try:
            folder = path if path.endswith(("/", os.sep)) else os.path.dirname(path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            out = record.save(path, regular_only=True)   # a FIFO with no reader would block the step
        except Exception as e:  # noqa: BLE001 (a full disk must not end the user's training)
            warnings.warn(f"torchledger Ledger(save_to={self.save_to!r}): step {index}'s record not "
                          f"saved: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)
            return
        if out not in self.saved:
            self.saved.append(out)

    def save(self, path) -> str:
        """Write the last traced step's record (``StepRecord.save``: under torchrun
        ``{rank}`` in ``path``, a folder, or a ``.rank{r}`` suffix keep the ranks' files apart)
        and return the path written."""
        if not self.records:
            raise RuntimeError("Ledger.save(): no step traced yet; wrap a step in `with ledger.step(): ...`")
        return self.records[-1].save(path)

    def _note_untraced(self, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and 0 <= seconds < float("inf")):
            return                  # a clock gone backwards or NaN/inf: no time to keep (MFU)
        times = self.untraced_seconds
        times.append(seconds)
        if len(times) > TIMES_KEPT:
            del times[: len(times) - TIMES_KEPT]

    def _keep(self, record) -> None:
        self.records.append(record)
        if len(self.records) > self.keep:
            del self.records[: len(self.records) - self.keep]
        self._window.append(record)

    def _edge(self) -> float:
        """The clock at a step edge; on CUDA after a synchronize (NB: a CPU-GPU sync point)."""
        if self._cuda is None:
            import torch
            p = next(self.model.parameters(), None)
            self._cuda = bool(p is not None and p.device.type == "cuda" and torch.cuda.is_available()
                              and type(p).__name__ != "FakeTensor")
        if self._cuda:
            import torch
            torch.cuda.synchronize()
        return self.clock()

    def time_step(self):
        """Context manager: run one untraced step and note its time (for MFU)."""
        return _Timed(self)

    def findings(self, **options) -> list:
        """Findings over the leak window (the last ``LEAK_WINDOW`` traced steps); ``options``
        as in ``[tool.torchledger]``. MFU uses the untraced steps' median time when there are
        any (tracing adds its own overhead to the traced ones)."""
        options.setdefault("peak_flops", self.peak_flops)
        if self.untraced_seconds and "step_seconds" not in options:
            options["step_seconds"] = sorted(self.untraced_seconds)[len(self.untraced_seconds) // 2]
            options["untraced_steps"] = len(self.untraced_seconds)
            options["untraced_seconds"] = list(self.untraced_seconds)   # totals.step_timing: spread
        window = list(self._window)
        found = run_checks(window, options)
        if window:                        # the latest record keeps them (to_dict, report)
            window[-1].findings = list(found)
            window[-1].totals.update(mfu_totals(window, options))  # the one MFU
        return found

    def report(self, **options) -> str:
        if not self.records:
            return "No steps traced yet: wrap a training step in `with ledger.step(): ...`."
        return render_table(self.records[-1], self.findings(), **options)


class _Timed:
    def __init__(self, ledger):
        self.ledger = ledger

    def __enter__(self):
        self.t0 = self.ledger._edge()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.ledger._note_untraced(self.ledger._edge() - self.t0)
        return False
