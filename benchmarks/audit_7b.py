"""`torchledger audit` of a Hugging Face Llama-2-7B file on fake tensors: wall time and peak RSS.

    python benchmarks/audit_7b.py [--repeats 3] [--example examples/hf_llama2_7b.py] [--json OUT]

Runs the real command line in a fresh process each time (imports included), batch 1,
sequence 2048, one step, with the step time predicted on an H100 (``--predict``), and reports
the median wall time and the largest peak RSS. Beside
it, interleaved run for run, the floor: a fresh process that imports the same things, builds
the same spec and runs the same step on fake tensors with no tracing, no analysis and no
report, and exits the same way. The ratio audit / floor is torchledger's cost; the floor is
what the machine, torch and transformers cost. Targets: <= 10 s wall, <= 1 GB RSS, audit /
floor <= 1.10x.
Needs `pip install transformers`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOOR = r"""
import os, sys, time
t0 = time.perf_counter()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
sys.path.insert(0, sys.argv[2])
from torchledger.audit.engine import load_entry
from torchledger.audit.spec import default_loss
t1 = time.perf_counter()
fn = load_entry(sys.argv[1])
with FakeTensorMode(allow_non_fake_inputs=True):
    spec = fn()
    t2 = time.perf_counter()
    model = spec.model
    opt = torch.optim.AdamW(model.parameters())
    loss = default_loss(model(**spec.inputs))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}", flush=True)
os._exit(0)
"""


def run_child(cmd) -> tuple[float, int, subprocess.CompletedProcess]:
    """Wall seconds, this child's own peak RSS in bytes, and the finished process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    return wall, usage.ru_maxrss * 1024, done        # Linux: ru_maxrss in KiB


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "hf_llama2_7b.py"))
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--predict", default="h100", metavar="GPU",
                    help="the audit predicts the step time on this GPU (default h100; 'none': no "
                         "prediction)")
    ap.add_argument("--gpu", default=None,
                    help="also run the audit with --gpu GPU (predicted step time) and report what the "
                         "prediction adds: the wall-time difference, and the prediction alone timed in "
                         "process (CPU time) on the audit's record")
    args = ap.parse_args()
    if args.gpu:
        return predict_cost(args)
    audit_cmd = [sys.executable, "-m", "torchledger", "audit", args.example, "--steps", "1",
                 "--format", "json"]
    if args.predict != "none":                  # the step-time prediction on (the target)
        audit_cmd += ["--gpu", args.predict]
    floor_cmd = [sys.executable, "-c", FLOOR, args.example, ROOT]
    walls, floors, parts, rss = [], [], [], 0
    for _ in range(args.repeats):               # interleaved, so drift of the machine hits both
        wall, peak, r = run_child(audit_cmd)
        if r.returncode not in (0, 1):
            sys.exit(f"audit failed ({r.returncode}): {r.stderr.strip()[-500:]}")
        walls.append(wall)
        rss = max(rss, peak)
        totals = json.loads(r.stdout)["totals"]
        wall, _, u = run_child(floor_cmd)
        if u.returncode != 0:
            sys.exit(f"floor run failed ({u.returncode}): {u.stderr.strip()[-500:]}")
        floors.append(wall)
        parts.append([float(x) for x in u.stdout.split()[-3:]])
    audit_s, floor_s = statistics.median(walls), statistics.median(floors)
    imports, build, step = (statistics.median(p[i] for p in parts) for i in range(3))
    out = {"audit_wall_s_median": audit_s, "audit_wall_s": walls, "floor_wall_s_median": floor_s,
           "floor_wall_s": floors, "audit_over_floor": audit_s / floor_s,
           "audit_over_floor_fastest": min(walls) / min(floors), "peak_rss_bytes": rss,
           "params": totals["params"], "flops_total": totals["flops"]["total"],
           "floor_parts_s": {"imports": imports, "load_and_build": build, "fake_step": step}}
    predicted = f", --gpu {args.predict}" if args.predict != "none" else ""
    print(f"audit (fake, 1 step{predicted}, imports included): median {audit_s:.2f} s over "
          f"{len(walls)} runs; peak RSS {rss / 2**20:.0f} MiB")
    print(f"floor (same imports, spec and fake step, untraced, no report): median {floor_s:.2f} s; "
          f"audit / floor = {audit_s / floor_s:.2f}x")
    print(f"fastest runs (the least disturbed by other jobs on the host): audit {min(walls):.2f} s, "
          f"floor {min(floors):.2f} s, audit / floor = {min(walls) / min(floors):.2f}x")
    print(f"floor parts (medians): import torch + torchledger {imports:.2f} s, load file + import "
          f"transformers + build {build:.2f} s, fake step {step:.2f} s")
    print(f"params {totals['params']:,}; FLOPs {totals['flops']['total']:,}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def predict_cost(args):
    """What ``--gpu`` (the predicted step time) adds to an audit: interleaved runs with and
    without it (wall, noisy on a shared host), and ``attach_step_time`` alone on the record
    (CPU time of this process, best of 5)."""
    sys.path.insert(0, ROOT)
    from torchledger.steptime.predict import attach_step_time
    from torchledger.record import StepRecord
    base = [sys.executable, "-m", "torchledger", "audit", args.example, "--steps", "1", "--format", "json"]
    plain, with_gpu, record = [], [], None
    for _ in range(args.repeats):
        wall, _, r = run_child(base)
        plain.append(wall)
        wall, _, r = run_child(base + ["--gpu", args.gpu])
        if r.returncode not in (0, 1):
            sys.exit(f"audit failed ({r.returncode}): {r.stderr.strip()[-500:]}")
        with_gpu.append(wall)
        record = r.stdout
    rec = StepRecord.from_json(record)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        attach_step_time(rec, args.gpu)
        best = min(best, time.process_time() - t0)
    a, b = statistics.median(plain), statistics.median(with_gpu)
    print(f"audit {os.path.basename(args.example)}: median {a:.2f} s without --gpu, {b:.2f} s with --gpu "
          f"{args.gpu} ({100 * (b - a) / a:+.1f}%, {len(plain)} interleaved runs each)")
    print(f"prediction alone (attach_step_time on the record, {len(rec.ops)} op rows, "
          f"{len(rec.collectives or [])} collective rows): {best * 1e3:.1f} ms CPU = {100 * best / a:.1f}% of the audit")


if __name__ == "__main__":
    main()
