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

from .step import StepTracer, active_tracer

__all__ = ["trace", "Ledger", "StepTracer", "active_tracer"]


class _Traced(StepTracer):
    """What ``trace()`` returns: a ``StepTracer`` with the report and findings at hand."""

    def report(self, **options) -> str:
        from ..report import render_table
        if self.record is None:
            raise RuntimeError("report() is available after the traced block ends")
        return render_table(self.record, self.findings(), **options)

    def findings(self, **options) -> list:
        from ..analyzers.checks import run_checks
        if self.record is None:
            raise RuntimeError("findings() are available after the traced block ends")
        return run_checks([self.record], **options)


def trace(model, optimizer=None, tokens=None, *, seq_len=None, peak_flops=None,
          clock=time.perf_counter) -> _Traced:
    """Trace one training step of ``model``; use as ``with trace(model, opt, tokens=N) as t``.

    ``tokens`` (tokens per step, for 6ND) and ``seq_len`` (for the attention term) are
    optional. ``peak_flops`` (FLOP/s) enables MFU.
    """
    return _Traced(model, optimizer=optimizer, tokens=tokens, peak_flops=peak_flops, clock=clock,
                   seq_len=seq_len)


class Ledger:
    """Trace many steps of an existing loop; one in ``sample_every`` is traced.

    ``with ledger.step(tokens=n): ...`` around each step. Untraced steps cost nothing but a
    counter. ``ledger.records`` holds one ``StepRecord`` per traced step.
    """

    def __init__(self, model, optimizer=None, *, sample_every: int = 1, peak_flops=None,
                 clock=time.perf_counter):
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every must be an int >= 1, got {sample_every!r}")
        self.model, self.optimizer = model, optimizer
        self.sample_every, self.peak_flops, self.clock = sample_every, peak_flops, clock
        self.records: list = []
        self.steps = 0
        self._carry: dict = {}      # storages kept by earlier traced steps (leak analysis)
        self.snapshot = None        # CUDA: the allocator snapshot of the last traced step

    @contextmanager
    def step(self, tokens=None, seq_len=None):
        i = self.steps
        self.steps += 1
        if i % self.sample_every:
            yield None
            return
        tracer = StepTracer(self.model, optimizer=self.optimizer, tokens=tokens,
                            peak_flops=self.peak_flops, clock=self.clock, step_index=i,
                            seq_len=seq_len, carry=self._carry)
        try:
            with tracer:
                yield tracer
        finally:
            if tracer.record is not None:
                self.records.append(tracer.record)
                self._carry = tracer.carry_out
                self.snapshot = getattr(tracer, "snapshot", None)

    def findings(self, **options) -> list:
        from ..analyzers.checks import run_checks
        return run_checks(self.records, **options)

    def report(self, **options) -> str:
        from ..report import render_table
        if not self.records:
            return "No steps traced yet: wrap a training step in `with ledger.step(): ...`."
        return render_table(self.records[-1], self.findings(), **options)
