"""The fixed cost of a traced step, and that it does not grow with the Python heap.

    python benchmarks/fixed_cost.py [--repeats 200] [--heap 1000000] [--json out.json]

A 2-layer MLP (16 -> 32 -> 4, ReLU) on a 4 x 16 batch with AdamW: a step of about 70 tiny
ops, so what a traced step costs beyond the untraced one is the tracer's own work (install,
per-op bookkeeping, the record, the findings), not arithmetic. Variants, interleaved step by
step, medians kept (machine noise hits every variant alike):

* untraced: the plain step;
* ``trace()``: ``with torchledger.trace(model, optimizer=opt, tokens=4)`` around it (record
  and findings at exit);
* ``Ledger``: ``with ledger.step(tokens=4)`` with ``sample_every=1``, the same input tensor
  fed every step (the loop that paid a full ``gc.collect()`` and ``gc.get_objects()`` walk
  per step before).

Then the same three again with ``--heap`` unrelated Python objects alive (a list of small
lists, all tracked by the garbage collector): a traced step that walked the heap would slow
down with it. Wall-clock times (``time.perf_counter``) and this process's CPU time
(``time.process_time``, which a busy shared machine disturbs less) are both reported; one
intra-op thread (the ops are tiny). Target: a traced step at most 3 ms more than untraced,
and no growth with the heap.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import torchledger


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)            # the same input every step
    ledger = torchledger.Ledger(model, optimizer=opt)

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def untraced():
        step()

    def traced():
        with torchledger.trace(model, optimizer=opt, tokens=4):
            step()

    def ledger_step():
        with ledger.step(tokens=4):
            step()

    return {"untraced": untraced, "trace()": traced, "Ledger": ledger_step}


def measure(runs: dict, repeats: int) -> dict:
    for fn in runs.values():          # warm-up: optimizer state, lazy inits, first traces
        for _ in range(3):
            fn()
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {}
    for k in runs:
        w, c = statistics.median(wall[k]), statistics.median(cpu[k])
        q = statistics.quantiles(wall[k], n=4)
        out[k] = {"wall_ms": 1e3 * w, "cpu_ms": 1e3 * c, "wall_iqr_ms": [1e3 * q[0], 1e3 * q[2]]}
    base = out["untraced"]
    for k, row in out.items():
        row["extra_wall_ms"] = row["wall_ms"] - base["wall_ms"]
        row["extra_cpu_ms"] = row["cpu_ms"] - base["cpu_ms"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--heap", type=int, default=1_000_000, help="unrelated objects kept alive in the second run")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {"torch": torch.__version__, "repeats": args.repeats}
    runs = setup()
    results["small_heap"] = measure(runs, args.repeats)
    results["small_heap"]["gc_objects"] = len(gc.get_objects())
    heap = [[i] for i in range(args.heap)]        # noqa: F841  kept alive, tracked by gc
    results["big_heap"] = measure(runs, args.repeats)
    results["big_heap"]["gc_objects"] = len(gc.get_objects())
    for section in ("small_heap", "big_heap"):
        rows = results[section]
        print(f"{section} ({rows['gc_objects']:,} objects tracked by gc)")
        for k in ("untraced", "trace()", "Ledger"):
            v = rows[k]
            print(f"  {k:10s} wall {v['wall_ms']:7.2f} ms (+{v['extra_wall_ms']:5.2f})"
                  f"  cpu {v['cpu_ms']:7.2f} ms (+{v['extra_cpu_ms']:5.2f})"
                  f"  wall IQR {v['wall_iqr_ms'][0]:.2f}-{v['wall_iqr_ms'][1]:.2f} ms")
    for k in ("trace()", "Ledger"):
        s, b = results["small_heap"][k]["wall_ms"], results["big_heap"][k]["wall_ms"]
        print(f"{k}: big heap / small heap {b / s:.2f}x (wall)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
