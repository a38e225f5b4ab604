"""`torchledger audit FILE --world-size N` on a 3-layer MLP sharded with FSDP2: wall time per N.

    python benchmarks/world_size.py [--sizes 4096,65536,1048576] [--steps 1] [--json OUT]

Each size runs the real command line in a fresh process (imports included). The simulated
world runs rank 0 only, so the time should not grow with N: before torchledger shared FSDP2's
per-rank chunks lazily (torchledger/audit/world.py, ``_rank_chunks_only``) ``fully_shard``
made two fake ``new_empty(0)`` per parameter per rank (4,096 ranks: 5.7 s; 65,536: 43.7 s;
1,048,576: over 300 s). Target: the largest world (``MAX_WORLD``, 1,048,576) under 30 s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = '''
import torch, torch.nn as nn
import torchledger


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def audit_spec():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return torchledger.AuditSpec(model, torch.randn(4, 64), parallelize=shard)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,1048576")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp_fsdp.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(MODEL)
        for n in (int(s) for s in args.sizes.split(",")):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "torchledger", "audit", path, "--world-size", str(n),
                                   "--steps", str(args.steps), "--format", "json"],
                                  capture_output=True, text=True, env=env, cwd=tmp)
            seconds = time.perf_counter() - t0
            ok = proc.returncode in (0, 1)
            world = json.loads(proc.stdout)["totals"]["world_size"] if ok else None
            rows.append({"world_size": n, "seconds": round(seconds, 2), "exit": proc.returncode,
                         "record_world_size": world})
            print(f"--world-size {n:>9,}: {seconds:6.1f} s (exit {proc.returncode})"
                  + ("" if ok else f": {proc.stderr.strip()[-300:]}"), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
