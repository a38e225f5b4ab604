"""The tracer's per-op bookkeeping alone: one step's ops replayed through ``LedgerMode._record``.

    python benchmarks/record_replay.py [--device fake|cpu] [--repeats 7]

Traces one step (``--device fake``: the llama2-7b preset on fake tensors, batch 1 x 2048;
``cpu``: gpt-mini, batch 8 x 128; AdamW, one thread), keeping every call the dispatch mode made
to ``_record`` (its arguments and the op's outputs), then replays them ``--repeats`` times into
a fresh tracer's mode with nothing else running: the time per op of the bookkeeping itself
(FLOPs, bytes, storages, shapes, module and phase rows), free of the step's kernels, the
FakeTensorMode work between ops and the machine's noise in a step's time. The tensors are kept
alive by the capture, so storages die only at the end: a replay sees no frees.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import torchledger
from tracer_overhead import STEPS, setup, step as one_step   # the benchmarks' two steps
from torchledger.tracer import dispatch
from torchledger.tracer.step import StepTracer


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("fake", "cpu"), default="fake")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = args.device == "fake"
    name = STEPS[args.device][0]
    calls = []
    record = dispatch.LedgerMode._record

    def capture(self, *a):
        calls.append(a)
        return record(self, *a)

    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, opt, inputs, tokens = setup(args.device)

        def step():
            one_step(model, opt, inputs)
        step()
        dispatch.LedgerMode._record = capture
        try:
            with torchledger.trace(model, optimizer=opt, tokens=tokens):
                step()
        finally:
            dispatch.LedgerMode._record = record
        seconds = []
        for _ in range(args.repeats):
            tracer = StepTracer(model, optimizer=opt)
            tracer.__enter__()
            try:
                replay = tracer.mode._record
                with torch._C._DisableTorchDispatch():     # no op the replay issues is traced
                    t0 = time.perf_counter()
                    for a in calls:
                        replay(*a)
                    seconds.append(time.perf_counter() - t0)
            finally:
                tracer.__exit__(None, None, None)
    best, median = min(seconds), statistics.median(seconds)
    print(f"{name} ({args.device}): {len(calls):,} ops; _record replayed {args.repeats} times: fastest "
          f"{best * 1e3:.2f} ms ({best / len(calls) * 1e6:.2f} us an op), median {median * 1e3:.2f} ms "
          f"({median / len(calls) * 1e6:.2f} us an op)")


if __name__ == "__main__":
    main()
