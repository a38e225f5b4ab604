"""What building a step's record costs the garbage collector, on the llama2-7b fake step.

    python benchmarks/record_gc.py [--repeats 5] [--steps 6] [--model llama2-7b] [--json out.json]

The step is ``benchmarks/tracer_overhead.py``'s ``bench_fake_7b`` (llama2-7b on fake tensors,
AdamW, batch 1 x 2048, one torch thread). CPython's generational collector runs a *full*
collection (generation 2: the whole heap, ~316k tracked objects with the fake model) when the
objects promoted to the oldest generation since the last one exceed 25% of it; every
container a traced step leaves tracked long enough to be promoted brings that closer, and a
full collection then lands inside a step. Printed:

1. ``record keeps``: GC-tracked containers (dict, list, tuple, set) reachable from the
   ``StepRecord`` after ``gc.collect()``, by field (deterministic).
2. ``build_record makes``: tracked objects alive when ``build_record`` returns that were not
   before it (the older heap frozen out of the collector's sight with ``gc.freeze()``, the
   collector otherwise as usual), and how many of those are still tracked after a collection
   of the young generations (tuples of plain values are untracked then; dicts only by a full
   collection, lists never): what each traced step adds towards the next full collection.
3. ``build_record`` median wall time with gc disabled (its own work, no collection in it).
4. Over ``--steps`` interleaved untraced/traced steps with gc enabled as usual: ``build_record``'s
   median wall time, and the number of collections (full, young) and the time they took, by
   where they started (untraced step, traced step before the record, ``build_record``).

Times are medians; run it on a quiet machine (it is a single-threaded benchmark).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracer_overhead import step  # noqa: E402  (the benchmarks' one training step)

import torchledger  # noqa: E402
from torchledger.models import build_model, example_inputs  # noqa: E402
from torchledger.tracer import step as step_module  # noqa: E402

_CONTAINERS = (dict, list, tuple, set)


def tracked_in(obj) -> int:
    """GC-tracked containers reachable from ``obj`` through dicts, lists, tuples and sets."""
    seen, todo, n = set(), [obj], 0
    while todo:
        x = todo.pop()
        if not isinstance(x, _CONTAINERS) or id(x) in seen:
            continue
        seen.add(id(x))
        n += gc.is_tracked(x)
        todo.extend(x.values() if isinstance(x, dict) else x)
    return n


def record_breakdown(record) -> dict:
    """``tracked_in`` per record field (``memory`` per key), after a full collection."""
    gc.collect()
    out = {}
    for name, value in vars(record).items():
        if name == "memory" and isinstance(value, dict):
            for key, sub in value.items():
                n = tracked_in(sub)
                if n:
                    out[f"memory.{key}"] = n
            out["memory (itself)"] = int(gc.is_tracked(value))
        else:
            n = tracked_in(value)
            if n:
                out[name] = n
    return out


class BuildProbe:
    """Wraps ``build_record`` (as ``tracer/step.py`` calls it) to count and time it."""

    def __init__(self):
        self.orig = step_module.build_record
        self.mode = "off"          # "count", "time" or "off" (gc as the user has it)
        self.counts = None
        self.seconds: list = []

    def __enter__(self):
        step_module.build_record = self
        return self

    def __exit__(self, *exc):
        step_module.build_record = self.orig
        return False

    def __call__(self, *args, **kwargs):
        if self.mode == "off":
            return self.orig(*args, **kwargs)
        gc.collect()
        if self.mode == "time":                 # its own work: no collection on the way
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                t0 = time.perf_counter()
                rec = self.orig(*args, **kwargs)
                self.seconds.append(time.perf_counter() - t0)
                return rec
            finally:
                if was_enabled:
                    gc.enable()
        # count: the collector runs as usual, but everything made before is frozen out of its
        # sight (and out of gc.get_objects()), so what it lists after is what build_record made
        gc.freeze()
        try:
            rec = self.orig(*args, **kwargs)
            made = gc.get_objects()
            n_made = len(made)
            by_type = dict(Counter(type(o).__name__ for o in made).most_common(6))
            gc.collect(1)                       # the young generations: tuples of atoms untracked
            still = sum(map(gc.is_tracked, made))
            del made
        finally:
            gc.unfreeze()
        self.counts = {"tracked at return": n_made, "still tracked after a young collection": still,
                       "by type at return": by_type}
        return rec


class Collections:
    """gc callbacks: count and time collections by generation and by the phase they start in."""

    def __init__(self):
        self.where = "other"
        self.n: dict = {}
        self.s: dict = {}
        self._t0 = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            key = (self.where, "full" if info["generation"] == 2 else "young")
            self.n[key] = self.n.get(key, 0) + 1
            self.s[key] = self.s.get(key, 0.0) + time.perf_counter() - self._t0


def run(model_name: str, batch: int, seq_len: int, repeats: int, steps: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    results: dict = {"model": model_name, "batch": batch, "seq_len": seq_len, "torch": torch.__version__,
                     "python": sys.version.split()[0], "gc_threshold": gc.get_threshold()}
    with FakeTensorMode(), BuildProbe() as probe:
        model = build_model(model_name)
        opt = torch.optim.AdamW(model.parameters())
        inputs = example_inputs(model_name, batch=batch, seq_len=seq_len)
        step(model, opt, inputs)                       # warm-up: optimizer state exists after

        def traced():
            with torchledger.trace(model, optimizer=opt, tokens=batch * seq_len) as t:
                step(model, opt, inputs)
            return t

        traced()                                       # warm-up: lazy imports, caches
        probe.mode = "count"
        t = traced()
        results["ops"] = t.record.meta.get("ops")
        results["build_record_makes"] = probe.counts
        results["record_keeps"] = record_breakdown(t.record)
        results["record_keeps_total"] = sum(v for v in results["record_keeps"].values())
        del t

        probe.mode = "time"
        for _ in range(repeats):
            traced()
        results["build_record_ms_gc_disabled"] = {
            "median": 1e3 * statistics.median(probe.seconds),
            "min": 1e3 * min(probe.seconds), "max": 1e3 * max(probe.seconds)}

        probe.mode = "off"
        seen = Collections()
        orig = probe.orig
        build_s: list = []

        def build_in_phase(*args, **kwargs):
            seen.where, saved = "build_record", seen.where
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                build_s.append(time.perf_counter() - t0)
                seen.where = saved
        probe.orig = build_in_phase
        gc.collect()
        gc.callbacks.append(seen)
        try:
            for _ in range(steps):
                seen.where = "untraced step"
                step(model, opt, inputs)
                seen.where = "traced step (before build_record)"
                with torchledger.trace(model, optimizer=opt, tokens=batch * seq_len):
                    step(model, opt, inputs)
                seen.where = "other"
        finally:
            gc.callbacks.remove(seen)
            probe.orig = orig
        results["collections"] = {f"{where}: {kind}": {"count": seen.n[(where, kind)],
                                                        "ms": round(1e3 * seen.s[(where, kind)], 1)}
                                  for where, kind in sorted(seen.n)}
        results["build_record_ms_gc_enabled"] = {
            "median": 1e3 * statistics.median(build_s), "min": 1e3 * min(build_s), "max": 1e3 * max(build_s)}
        results["heap_tracked_objects"] = len(gc.get_objects())
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5, help="traced steps timed for build_record")
    ap.add_argument("--steps", type=int, default=6, help="untraced/traced pairs for the collection count")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r = run(args.model, args.batch, args.seq_len, args.repeats, args.steps)
    print(f"{r['model']} fake step, batch {r['batch']} x {r['seq_len']}: {r['ops']} ops; "
          f"python {r['python']}, torch {r['torch']}, gc threshold {r['gc_threshold']}, "
          f"{r['heap_tracked_objects']} tracked objects in the heap")
    print(f"record keeps {r['record_keeps_total']} tracked containers:")
    for k, v in sorted(r["record_keeps"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {v:8d}")
    print("build_record makes (tracked objects):")
    for k, v in r["build_record_makes"].items():
        print(f"  {k:40s} {v}")
    b = r["build_record_ms_gc_disabled"]
    print(f"build_record, gc disabled: median {b['median']:.1f} ms (min {b['min']:.1f}, max {b['max']:.1f}; "
          f"{args.repeats} steps)")
    b = r["build_record_ms_gc_enabled"]
    print(f"build_record, gc enabled: median {b['median']:.1f} ms (min {b['min']:.1f}, max {b['max']:.1f}; "
          f"{args.steps} steps below)")
    print(f"collections over {args.steps} untraced/traced step pairs (full = generation 2):")
    for k, v in r["collections"].items():
        print(f"  {k:48s} {v['count']:5d}  {v['ms']:8.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
