"""How long ``torchledger plan`` takes (issue 35's targets: Llama-3-8B on 64 H100 at global
batch 64 in under 5 minutes, Llama-3-70B on 512 H100 in under 10, at least 500 candidates
each, on the 2-core development machine).

    python benchmarks/plan_speed.py                 # both, whole searches (hours today)
    python benchmarks/plan_speed.py --sample 4      # price 4 chains of each, extrapolate

The search asked for is wide enough for 500 candidates: dims dp, tp, pp; checkpointing
none, full, selective-op; schedules 1f1b, interleaved, gpipe, zero-bubble. Printed per case:
the candidates, the rejected, the traced, the seconds, and with --sample the seconds a traced
candidate took and the whole search's time at that rate (an extrapolation, said so).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CASES = [  # (name, preset, GPUs, global batch, target seconds)
    ("Llama-3-8B on 64 H100", "llama3-8b", 64, 64, 300),
    ("Llama-3-70B on 512 H100", "llama3-70b", 512, 512, 600),
]
SEARCH = {"dims": ("dp", "tp", "pp"), "checkpointing": ("none", "full", "selective-op"),
          "schedules": ("1f1b", "interleaved", "gpipe", "zero-bubble")}
MODEL = '''
import torch, torchledger
from torchledger.models import build_model, get_config

def audit_spec():
    cfg = get_config("{preset}")
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 8192))
    return torchledger.AuditSpec(model, {{"idx": idx, "targets": idx}})
'''


def run_case(name, preset, gpus, batch, target, sample, jobs, folder) -> None:
    from torchledger.formulas.hardware import get_gpu
    from torchledger.plan import search as plan_search
    from torchledger.plan.evaluate import probe
    from torchledger.plan.space import enumerate_space
    path = os.path.join(folder, f"{preset}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(MODEL.format(preset=preset))
    space = enumerate_space(probe(path), gpus, batch, SEARCH["dims"], SEARCH["checkpointing"], SEARCH["schedules"],
                            gpus_per_node=get_gpu("h100").gpus_per_node)
    n = len(space.candidates)
    chains = plan_search.chains(space.candidates)
    print(f"{name}: {n:,} candidates in {len(chains):,} chains, {sum(space.rejected.values()):,} rejected before "
          f"tracing; target {target} s", flush=True)
    if sample:
        # the chains spread over the space: every k-th, so meshes of every kind are timed
        keep = chains[::max(1, len(chains) // sample)][:sample]
        plan_search.chains = lambda candidates, _keep=keep: _keep
    t0 = time.perf_counter()
    result = plan_search.search(path, "h100", gpus, batch, jobs=jobs, **SEARCH)
    seconds = time.perf_counter() - t0
    traced = result["traced"]
    print(f"  traced {traced:,} in {seconds:,.0f} s ({seconds / max(traced, 1):.1f} s a traced candidate, "
          f"{jobs} job(s)); best: {result['plans'][0]['mesh'] if result['plans'] else 'none fits'}", flush=True)
    if sample:
        print(f"  extrapolated (every candidate traced at that rate): {n * seconds / max(traced, 1) / 60:,.0f} min, "
              f"target {target / 60:.0f} min", flush=True)
    else:
        print(f"  {'meets' if seconds <= target else 'misses'} the target: {seconds:,.0f} s of {target} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=0, help="price only this many chains of each case")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--case", type=int, choices=range(len(CASES)), default=None, help="run only this case")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for i, case in enumerate(CASES):
            if args.case is None or args.case == i:
                run_case(*case, args.sample, args.jobs, folder)


if __name__ == "__main__":
    main()
