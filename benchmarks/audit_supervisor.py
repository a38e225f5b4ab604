"""What running the model file in a child process (``torchledger/audit/supervise.py``) costs.

    python benchmarks/audit_supervisor.py [--repeats 5] [--example examples/gpt2_tiny.py] [--json OUT]

1. End to end: ``python -m torchledger audit FILE --steps 1`` (supervised: the audit runs in a
   forked child) against ``python -m torchledger --debug audit FILE --steps 1`` (the same
   audit in the one process), fresh processes, interleaved run for run; median wall times and
   their difference.
2. The supervisor alone: ``supervise(work)`` with a ``work`` that returns at once (fork, pipe,
   wait for the child's exit), median of 20, from a parent without torch (the command line)
   and from one with torch imported (the CLI called in-process, which also imports an audit's
   modules before the first fork: reported apart as ``first_call_s``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALONE = r"""
import json, statistics, sys, time
if sys.argv[1] == "torch":
    import torch  # noqa: F401
from torchledger.audit.supervise import supervise
t0 = time.perf_counter()
supervise(lambda: {"x": 0}, timeout=60, model_path="x.py")
first = time.perf_counter() - t0
times = []
for _ in range(20):
    t0 = time.perf_counter()
    supervise(lambda: {"x": 0}, timeout=60, model_path="x.py")
    times.append(time.perf_counter() - t0)
print(json.dumps({"first_call_s": first, "median_s": statistics.median(times)}))
"""


def _wall(args) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torchledger", *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)}: exit {r.returncode}: {r.stderr[-500:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "gpt2_tiny.py"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    audit = ["audit", a.example, "--steps", "1"]
    supervised, inprocess = [], []
    for _ in range(a.repeats):
        supervised.append(_wall(audit))
        inprocess.append(_wall(["--debug", *audit]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    alone = {}
    for parent in ("plain", "torch"):
        r = subprocess.run([sys.executable, "-c", ALONE, parent], capture_output=True, text=True, env=env,
                           check=True)
        alone[parent] = json.loads(r.stdout)
    out = {"example": os.path.relpath(a.example, ROOT), "repeats": a.repeats,
           "supervised_median_s": statistics.median(supervised),
           "inprocess_median_s": statistics.median(inprocess),
           "difference_s": statistics.median(supervised) - statistics.median(inprocess),
           "supervise_alone": alone}
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
