"""How the time of `torchledger audit --world-size N` grows with N (simulated ranks).

    python benchmarks/world_scaling.py [--sizes 8,64,256,1024] [--example examples/llama2_7b_fsdp.py] [--json OUT]

Each size is the real command line in a fresh process (imports included), one step, fake
tensors under PyTorch's fake process group, rank 0 of N. Printed per size: wall seconds, CPU
seconds (user + system: steadier than wall on a shared machine), peak RSS, and rank 0's
static bytes and FLOPs (the figures a bigger world must not disturb: static bytes shrink as
1/N, FLOPs stay). Then, per step of N, how much each added rank costs.

In-process, ``--profile N`` runs the same audit at one size under cProfile and prints where
the time goes (PyTorch's ``fully_shard`` setup against torchledger's own tracing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from audit_7b_fsdp import audit as run_audit_process  # noqa: E402  (one fresh audit process, timed)


def audit(example: str, n: int):
    cmd = [sys.executable, "-m", "torchledger", "audit", example, "--world-size", str(n),
           "--steps", "1", "--format", "json"]
    wall, cpu, rss_bytes, totals = run_audit_process(cmd)
    return {"world_size": n, "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": rss_bytes / 2 ** 20,
            "static_bytes": totals.get("param_bytes", 0) + totals.get("grad_bytes", 0)
            + totals.get("optimizer_state_bytes", 0),
            "flops": totals["flops"]["total"], "comm_bytes": (totals.get("comm_bytes") or {}).get("total")}


def profile(example: str, n: int) -> None:
    import cProfile
    import pstats
    from click.testing import CliRunner

    from torchledger.cli import cli
    pr = cProfile.Profile(time.process_time)
    pr.enable()
    CliRunner().invoke(cli, ["audit", example, "--world-size", str(n), "--steps", "1", "--format", "json"])
    pr.disable()
    s = pstats.Stats(pr)
    s.sort_stats("cumtime").print_stats(r"fully_shard|torchledger/(audit|tracer/step)|_fsdp_param\.py", 20)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "llama2_7b_fsdp.py"))
    ap.add_argument("--profile", type=int, help="profile one audit at this world size instead")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    if args.profile:
        profile(args.example, args.profile)
        return
    rows = [audit(args.example, int(n)) for n in args.sizes.split(",")]
    for r in rows:
        print(f"N={r['world_size']:5d}  wall {r['wall_s']:7.1f} s  cpu {r['cpu_s']:7.1f} s  "
              f"RSS {r['peak_rss_mib']:6.0f} MiB  rank-0 static {r['static_bytes']:,} B  "
              f"FLOPs {r['flops']:,}")
    for a, b in zip(rows, rows[1:]):
        dn = b["world_size"] - a["world_size"]
        print(f"N {a['world_size']} -> {b['world_size']}: +{(b['cpu_s'] - a['cpu_s']) / dn * 1e3:.1f} ms "
              f"CPU per added rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
