"""Llama-3.1-405B at TP 8 x CP 2 x PP 9 x FSDP 4 (576 ranks) with 7 virtual stages: the real
`torchledger audit` command in a fresh process, its wall and CPU time, and each distinct
pipeline rank's figures from the record's ``totals.pipeline``.

    python benchmarks/audit_405b_4d.py [--micro-batches 18] [--checkpointing full] [--json OUT]

CPU seconds are the audit's and its children's (each distinct pipeline rank is traced in its
own process), user + system: steadier than wall on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "examples", "llama3_405b_4d.py")
MESH = "dp=4,cp=2,tp=8,pp=9"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=18)
    ap.add_argument("--virtual-stages", type=int, default=7)
    ap.add_argument("--checkpointing", default="none",
                    choices=["none", "full", "selective-op", "selective-layer"])
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "405b.json")
        cmd = [sys.executable, "-m", "torchledger", "audit", MODEL, "--mesh", MESH,
               "--virtual-stages", str(args.virtual_stages), "--micro-batches", str(args.micro_batches),
               "--precision", "bf16-mixed", "--checkpointing", args.checkpointing, "--gpu", "h100",
               "--format", "json", "--output", out]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode not in (0, 1) or not os.path.exists(out):
            sys.exit(f"audit failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        with open(out) as f:
            rec = json.load(f)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    pp = rec["totals"]["pipeline"]
    print(f"audit {os.path.relpath(MODEL, ROOT)} --mesh {MESH} --virtual-stages {pp['virtual_stages']} "
          f"--micro-batches {pp['micro_batches']} --precision bf16-mixed --checkpointing {args.checkpointing}")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (audit and its rank processes), "
          f"{pp['ranks_traced']} distinct pipeline ranks traced of {pp['stages']}")
    print(f"schedule {pp['schedule']}, bubble (p-1)/(v m) = {pp['bubble_fraction']:.4f}, "
          f"bounding rank {pp['bounding_rank']}")
    gb = 1e9
    print(f"{'rank':>4} {'alike':>8} {'blocks':>6} {'in flight':>9} {'peak GB':>8} {'static GB':>9} "
          f"{'act/mb GB':>9} {'comm GB':>8} {'p2p GB':>7} {'TFLOP':>8}")
    for s in pp["per_stage"]:
        alike = s["ranks_alike"]
        alike = f"{alike[0]}-{alike[-1]}" if len(alike) > 1 else str(alike[0])
        print(f"{s['rank']:>4} {alike:>8} {s['blocks']:>6} {s['in_flight']:>9} {s['peak_bytes'] / gb:>8.1f} "
              f"{s['static_bytes'] / gb:>9.2f} {s['activation_bytes_per_micro_batch'] / gb:>9.2f} "
              f"{s['comm_bytes']['total'] / gb:>8.1f} {s['p2p_bytes'] / gb:>7.2f} {s['flops']['total'] / 1e12:>8.0f}")
    st = (rec.get("predictions") or {}).get("step_time") or {}
    if st:
        print(f"predicted step time on {st['gpu']}: {st['seconds']:.2f} s ({st['micro_batches']} micro-batches), "
              f"MFU {st['mfu']:.3f}, bubble {st['bubble_seconds']:.2f} s, communication {st['comm_seconds']:.2f} s "
              f"({st['comm_exposed_seconds']:.2f} s exposed)")
    for row in (rec.get("predictions") or {}).get("comparisons") or ():
        print(f"  {row['quantity']:<42} {row['measured']:>26,} vs {row['predicted']:>26,}  {row['ratio']:.3f}x")
    for finding in rec.get("findings") or ():
        if finding["rule"].startswith(("TL-CMP", "TL-TRACE", "TL-MFU")):
            print(f"  {finding['rule']}: {finding['message'][:160]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "cpu_s": cpu, "pipeline": pp}, f, indent=1)


if __name__ == "__main__":
    main()
