"""Where a traced step's extra time goes, part by part, measured side by side in one run.

    python benchmarks/fake_step_parts.py [--repeats 5] [--device fake|cpu] [--json OUT]

``--device fake`` (default): the llama2-7b preset on fake tensors, batch 1 x 2048; ``--device
cpu``: gpt-mini on the CPU, batch 8 x 128 (tracer_overhead.py's two steps); AdamW, one thread,
after one warm-up step. Each round runs these variants one after another (medians and fastest
runs of this process's CPU time, ratios to the untraced step):

* untraced: the plain fake step;
* saved-tensor hooks alone: ``saved_tensors_hooks(lambda t: t, lambda t: t)`` around the step,
  no tracer (any tracer that sees activations through autograd's saved-tensor hooks pays it: on
  fake tensors autograd makes each unpacked saved tensor anew through FakeTensorMode);
* a pass-through dispatch mode (cpu only: the floor of any dispatch tracer there);
* torchledger, per-op bookkeeping off: ``trace()`` with ``LedgerMode._record`` replaced by a
  no-op (hooks, phases, module scope, entry and exit of the tracer kept; the record it builds
  is empty): what observing costs before any op is counted;
* torchledger: ``trace()`` as users run it.

The differences between rows are the parts: hooks, the tracer's frame (install, phase and
module per op, record and findings), the per-op bookkeeping (FLOPs, bytes, storages, shapes).
Also printed: the tracer's entry, ``build_record`` and findings, timed inside the full runs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import torchledger
from tracer_overhead import STEPS, _PassThrough, _same, setup, step as one_step   # the benchmarks' two steps
from torchledger import ledger as ledger_mod
from torchledger.tracer import dispatch, step as step_mod




def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("fake", "cpu"), default="fake")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    parts: dict = {"enter": [], "build_record": [], "findings": []}
    enter, build, findings = (step_mod.StepTracer.__enter__, step_mod.build_record,
                              ledger_mod._Traced.findings)

    def timed(fn, key):
        def wrapped(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                parts[key].append(time.process_time() - t0)
        return wrapped

    record = dispatch.LedgerMode._record
    fake = args.device == "fake"
    name, batch, seq = STEPS[args.device]
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, opt, inputs, tokens = setup(args.device)

        def step():
            one_step(model, opt, inputs)

        def traced():
            with torchledger.trace(model, optimizer=opt, tokens=tokens):
                step()

        def pass_through():
            with _PassThrough():
                step()

        def hooks():
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                step()

        def no_record():
            dispatch.LedgerMode._record = lambda self, *a: None
            try:
                traced()
            finally:
                dispatch.LedgerMode._record = record

        def full():
            step_mod.StepTracer.__enter__ = timed(enter, "enter")
            step_mod.build_record = timed(build, "build_record")
            ledger_mod._Traced.findings = timed(findings, "findings")
            try:
                traced()
            finally:
                step_mod.StepTracer.__enter__, step_mod.build_record = enter, build
                ledger_mod._Traced.findings = findings

        runs = {"untraced": step, "saved-tensor hooks alone": hooks,
                **({} if fake else {"pass-through dispatch mode": pass_through}),
                "torchledger, per-op bookkeeping off": no_record, "torchledger": full}
        step()                                           # optimizer state exists from here on
        cpu = {k: [] for k in runs}
        for _ in range(args.repeats):
            for k, fn in runs.items():
                t0 = time.process_time()
                fn()
                cpu[k].append(time.process_time() - t0)
    base, fastest = statistics.median(cpu["untraced"]), min(cpu["untraced"])
    out = {k: {"cpu_median_ms": 1e3 * statistics.median(v), "ratio": statistics.median(v) / base,
               "cpu_min_ms": 1e3 * min(v), "min_ratio": min(v) / fastest} for k, v in cpu.items()}
    where = "on fake tensors" if fake else "on the CPU"
    print(f"{name} {where}, batch {batch} x {seq}, AdamW; {args.repeats} rounds, CPU time")
    for k, v in out.items():
        print(f"  {k:38s} median {v['cpu_median_ms']:7.1f} ms {v['ratio']:5.2f}x   "
              f"fastest {v['cpu_min_ms']:7.1f} ms {v['min_ratio']:5.2f}x")
    out["parts_ms"] = {k: 1e3 * statistics.median(v) for k, v in parts.items() if v}
    print("  inside the traced runs (medians): " + ", ".join(
        f"{k} {v:.1f} ms" for k, v in out["parts_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
