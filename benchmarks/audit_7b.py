"""`torchledger audit` of a Hugging Face Llama-2-7B file on fake tensors: wall time and peak RSS.

    python benchmarks/audit_7b.py [--repeats 3] [--example examples/hf_llama2_7b.py]

Runs the real command line in a fresh process each time (imports included), batch 1,
sequence 2048, one step, and reports the median wall time and the largest peak RSS
(getrusage of the child). Beside it, the same model's untraced fake step in one process,
so the tracer's share of the time is visible. Targets: <= 10 s wall, <= 1 GB RSS.
Needs `pip install transformers`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

UNTRACED = r"""
import time, sys
t0 = time.perf_counter()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
sys.path.insert(0, sys.argv[2])
from torchledger.audit import load_entry, default_loss
fn = load_entry(sys.argv[1])
with FakeTensorMode(allow_non_fake_inputs=True):
    t1 = time.perf_counter()
    spec = fn()
    t2 = time.perf_counter()
    model = spec.model
    opt = torch.optim.AdamW(model.parameters())
    loss = default_loss(model(**spec.inputs))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}")
"""


def child_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # Linux: KiB


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "hf_llama2_7b.py"))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "torchledger", "audit", args.example, "--steps", "1",
                            "--format", "json"], capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        if r.returncode not in (0, 1):
            sys.exit(f"audit failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    totals = json.loads(r.stdout)["totals"]
    rss = child_rss_bytes()
    u = subprocess.run([sys.executable, "-c", UNTRACED, args.example, ROOT], capture_output=True,
                       text=True, cwd=ROOT)
    imports, build, step = (float(x) for x in u.stdout.split()[-3:])
    out = {"audit_wall_s_median": statistics.median(walls), "audit_wall_s": walls,
           "peak_rss_bytes": rss, "params": totals["params"], "flops_total": totals["flops"]["total"],
           "untraced": {"imports_s": imports, "build_s": build, "step_s": step}}
    print(f"audit (fake, 1 step, imports included): median {out['audit_wall_s_median']:.2f} s "
          f"over {len(walls)} runs; peak RSS {rss / 2**20:.0f} MiB")
    print(f"params {totals['params']:,}; FLOPs {totals['flops']['total']:,}")
    print(f"untraced in one process: imports {imports:.2f} s, build {build:.2f} s, fake step {step:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
