"""Simulated world size against a single rank: `torchledger audit` of Llama-2-7B with FSDP2 at
64 ranks (fake tensors, fake process group) and of the same model as one process.

    python benchmarks/audit_7b_fsdp.py [--repeats 1] [--world-size 64] [--json OUT]

Each audit is the real command line in a fresh process (imports included), batch 1 x 2048
tokens per rank, one step, runs interleaved; prints the median wall times, their ratio
(simulated / single) in wall and in CPU seconds (user + system, steadier on a shared
machine), the peak RSS of each, and rank 0's static bytes against ZeRO-3's
closed form (16 bytes per parameter for fp32 AdamW, divided by the world size).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SINGLE = os.path.join(ROOT, "examples", "llama2_7b.py")
FSDP = os.path.join(ROOT, "examples", "llama2_7b_fsdp.py")


def audit(cmd):
    """Wall seconds, CPU seconds (user + system: steadier than wall on a shared machine), peak
    RSS in bytes and the record's totals of one fresh ``torchledger audit`` process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code not in (0, 1):
        sys.exit(f"{' '.join(cmd[2:])} failed ({code}): {stderr.strip()[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, json.loads(stdout)["totals"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    base = [sys.executable, "-m", "torchledger", "audit", "--steps", "1", "--format", "json"]
    single_cmd = base[:4] + [SINGLE] + base[4:]
    fsdp_cmd = base[:4] + [FSDP, "--world-size", str(args.world_size)] + base[4:]
    singles, sims, cpu, rss = [], [], {"single": [], "simulated": []}, {"single": 0, "simulated": 0}
    for _ in range(args.repeats):               # interleaved: drift of the machine hits both
        wall, seconds, peak, single = audit(single_cmd)
        singles.append(wall)
        cpu["single"].append(seconds)
        rss["single"] = max(rss["single"], peak)
        wall, seconds, peak, sim = audit(fsdp_cmd)
        sims.append(wall)
        cpu["simulated"].append(seconds)
        rss["simulated"] = max(rss["simulated"], peak)
    s, f = statistics.median(singles), statistics.median(sims)
    cs, cf = statistics.median(cpu["single"]), statistics.median(cpu["simulated"])
    n, world = sim["params"], args.world_size
    zero3 = 16 * n / world                      # fp32 weights 4 + grads 4 + AdamW m, v 8, over N ranks
    static = {k: sim.get(k) for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")}
    out = {"single_wall_s": singles, "simulated_wall_s": sims, "ratio": f / s, "cpu_s": cpu,
           "cpu_ratio": cf / cs, "peak_rss_bytes": rss,
           "world_size": world, "params": n, "rank0_static_bytes": static,
           "zero3_static_bytes_per_rank": zero3, "rank0_peak_bytes": sim.get("peak_bytes"),
           "single_peak_bytes": single.get("peak_bytes")}
    print(f"single rank  (examples/llama2_7b.py): median wall {s:.1f} s (CPU {cs:.1f} s) over "
          f"{len(singles)} run(s), peak RSS {rss['single'] / 2**20:,.0f} MiB")
    print(f"world size {world} (examples/llama2_7b_fsdp.py, FSDP2): median wall {f:.1f} s (CPU {cf:.1f} s), "
          f"peak RSS {rss['simulated'] / 2**20:,.0f} MiB")
    print(f"simulated / single: wall {f / s:.2f}x, CPU {cf / cs:.2f}x")
    print(f"rank 0 static bytes: params {static['param_bytes']:,}, grads {static['grad_bytes']:,}, "
          f"AdamW state {static['optimizer_state_bytes']:,}; ZeRO-3 closed form 16 x {n:,} / {world} = "
          f"{zero3:,.0f} in all, {zero3 / 4:,.0f} per category of 4 B/param")
    print(f"rank 0 peak {sim.get('peak_bytes', 0):,} B vs single-process peak {single.get('peak_bytes', 0):,} B")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
