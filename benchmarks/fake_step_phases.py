"""Where tracing a fake step costs time: forward, backward and optimizer, traced vs untraced.

    python benchmarks/fake_step_phases.py [--example examples/hf_llama2_7b.py] [--repeats 2]

Builds the example's spec on fake tensors (as ``torchledger audit`` does), then runs one
step untraced and one traced, alternating, ``--repeats`` times; prints the median seconds of
each phase and of the tracer's entry and exit, and how many ops FakeTensorMode dispatched
(all of them, and ``aten.detach``: the saved-tensor hooks make autograd detach each saved
tensor once more when backward unpacks it). Needs transformers for the default example.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "hf_llama2_7b.py"))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchledger.audit.engine import load_entry
    from torchledger.audit.spec import _call, default_loss
    from torchledger.audit.spec import as_spec
    from torchledger.tracer.step import StepTracer

    counts = collections.Counter()
    original = FakeTensorMode.dispatch

    def counting(self, func, types, args=(), kwargs=None):
        counts[str(func)] += 1
        return original(self, func, types, args, kwargs)

    fn = load_entry(args.example)
    times = {"untraced": collections.defaultdict(list), "traced": collections.defaultdict(list)}
    ops = {}
    FakeTensorMode.dispatch = counting
    try:
        for _ in range(args.repeats):
            for kind in ("untraced", "traced"):
                with FakeTensorMode(allow_non_fake_inputs=True):
                    spec = as_spec(fn())
                    model, opt = spec.model, torch.optim.AdamW(spec.model.parameters())
                    tracer = StepTracer(model, optimizer=opt, tokens=1) if kind == "traced" else None
                    counts.clear()
                    t = [time.perf_counter()]
                    if tracer:
                        tracer.__enter__()
                    t.append(time.perf_counter())
                    loss = default_loss(_call(model, spec.inputs))
                    t.append(time.perf_counter())
                    loss.backward()
                    t.append(time.perf_counter())
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t.append(time.perf_counter())
                    if tracer:
                        tracer.__exit__(None, None, None)
                    t.append(time.perf_counter())
                    for name, a, b in (("enter", 0, 1), ("forward", 1, 2), ("backward", 2, 3),
                                       ("optimizer", 3, 4), ("exit", 4, 5)):
                        times[kind][name].append(t[b] - t[a])
                    ops[kind] = (sum(counts.values()), counts["aten.detach.default"])
                    del spec, model, opt, loss, tracer
    finally:
        FakeTensorMode.dispatch = original
    print(f"{os.path.relpath(args.example)} on fake tensors, medians of {args.repeats} (seconds)")
    print(f"{'phase':10s} {'untraced':>9s} {'traced':>9s} {'extra':>7s}")
    for name in ("enter", "forward", "backward", "optimizer", "exit"):
        u, tr = (statistics.median(times[k][name]) for k in ("untraced", "traced"))
        print(f"{name:10s} {u:9.2f} {tr:9.2f} {tr - u:+7.2f}")
    for kind in ("untraced", "traced"):
        print(f"{kind}: FakeTensorMode dispatched {ops[kind][0]:,} ops, {ops[kind][1]:,} of them aten.detach")


if __name__ == "__main__":
    main()
