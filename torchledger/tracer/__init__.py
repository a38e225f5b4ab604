"""Tracers: observe a real training step and hand back a plain ``StepRecord``.

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

import time
from contextlib import contextmanager

from ..analyzers.mfu import mfu_totals
from .compiled import note_run
from .step import StepTracer, active_tracer, check_optimizer

__all__ = ["trace", "Ledger", "StepTracer", "active_tracer"]


class _Traced(StepTracer):
    """What ``trace()`` returns: a ``StepTracer`` with the report and findings at hand."""

    def report(self, **options) -> str:
        from ..report import render_table
        if self.record is None:
            raise RuntimeError("report() is available after the traced block ends")
        return render_table(self.record, self.findings(), **options)

    def __exit__(self, exc_type, exc, tb):
        out = super().__exit__(exc_type, exc, tb)
        note_run(self)                  # meta.compiled / meta.autocast
        _keep_findings(self.record, self.findings)
        return out

    def findings(self, **options) -> list:
        """Findings of every analyzer; ``options`` as in ``[tool.torchledger]`` (and
        ``peak_flops`` for MFU, defaulting to the one given to ``trace``). The record keeps
        the last ones computed (``record.findings``, in ``to_dict()``), so a saved record
        renders them offline."""
        from ..analyzers.checks import run_checks
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
          clock=time.perf_counter, tokens_source=None) -> _Traced:
    """Trace one training step of ``model``; use as ``with trace(model, opt, tokens=N) as t``.

    ``tokens`` (tokens per step, for 6ND) and ``seq_len`` (for the attention term) are
    optional. ``peak_flops`` (FLOP/s) enables MFU. ``tokens_source`` says how ``tokens`` was
    obtained, for reports (``totals.tokens_source``; default "given").
    """
    return _Traced(model, optimizer=optimizer, tokens=tokens, peak_flops=peak_flops, clock=clock,
                   seq_len=seq_len, tokens_source=tokens_source)


class Ledger:
    """Trace many steps of an existing loop; one in ``sample_every`` is traced.

    ``with ledger.step(tokens=n): ...`` around each step. Untraced steps cost nothing but a
    counter. ``ledger.records`` holds one ``StepRecord`` per traced step.
    """

    def __init__(self, model, optimizer=None, *, sample_every: int = 1, peak_flops=None,
                 clock=time.perf_counter):
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every must be an int >= 1, got {sample_every!r}")
        check_optimizer(optimizer, "Ledger()")
        self.model, self.optimizer = model, optimizer
        self.sample_every, self.peak_flops, self.clock = sample_every, peak_flops, clock
        self.records: list = []
        self.steps = 0
        self._carry: dict = {}      # storages kept by earlier traced steps (leak analysis)
        self.snapshot = None        # CUDA: the allocator snapshot of the last traced step
        self.untraced_seconds: list = []   # wall time of each untraced step
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
            self.untraced_seconds.append(self._edge() - t0)
            return
        tracer = StepTracer(self.model, optimizer=self.optimizer, tokens=tokens,
                            peak_flops=self.peak_flops, clock=self.clock, step_index=i,
                            seq_len=seq_len, carry=self._carry, tokens_source=tokens_source)
        try:
            with tracer:
                yield tracer
        finally:
            if tracer.record is not None:
                note_run(tracer)        # meta.compiled / meta.autocast
                self.records.append(tracer.record)
                self._carry = tracer.carry_out
                self.snapshot = getattr(tracer, "snapshot", None)
                _keep_findings(tracer.record, self.findings)

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
        """Findings over the traced steps; MFU uses the untraced steps' median time when
        there are any (tracing adds its own overhead to the traced ones)."""
        from ..analyzers.checks import run_checks
        options.setdefault("peak_flops", self.peak_flops)
        if self.untraced_seconds and "step_seconds" not in options:
            options["step_seconds"] = sorted(self.untraced_seconds)[len(self.untraced_seconds) // 2]
            options["untraced_steps"] = len(self.untraced_seconds)
        found = run_checks(self.records, options)
        if self.records:                  # the latest record keeps them (to_dict, report)
            self.records[-1].findings = list(found)
            self.records[-1].totals.update(mfu_totals(self.records, options))  # the one MFU
        return found

    def report(self, **options) -> str:
        from ..report import render_table
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
            self.ledger.untraced_seconds.append(self.ledger._edge() - self.t0)
        return False
