"""How long ``torchledger plan`` takes (issue 35's targets: Llama-3-8B on 64 H100 at global
batch 64 in under 5 minutes, Llama-3-70B on 512 H100 in under 10, at least 500 candidates
each, on the 2-core development machine).

    python benchmarks/plan_speed.py                 # both, whole searches (hours today)
    python benchmarks/plan_speed.py --sample 4      # price 4 chains of each, extrapolate
    python benchmarks/plan_speed.py --check 6       # 6 layouts priced per block and whole

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
    facts = probe(path)
    space = enumerate_space(facts, gpus, batch, SEARCH["dims"], SEARCH["checkpointing"], SEARCH["schedules"],
                            gpus_per_node=get_gpu("h100").gpus_per_node)
    n = len(space.candidates)
    chains = plan_search.chains(space.candidates, facts)
    print(f"{name}: {n:,} candidates in {len(chains):,} chains, {sum(space.rejected.values()):,} rejected before "
          f"tracing; target {target} s", flush=True)
    every = plan_search.chains
    if sample:
        # the chains spread over the space: every k-th, so meshes of every kind are timed
        keep = chains[::max(1, len(chains) // sample)][:sample]
        plan_search.chains = lambda candidates, facts=None, _keep=keep: _keep
    t0 = time.perf_counter()
    try:
        result = plan_search.search(path, "h100", gpus, batch, jobs=jobs, **SEARCH)
    finally:
        plan_search.chains = every
    seconds = time.perf_counter() - t0
    traced, priced = result["traced"], result["composed"]
    done = sum(len(g) for ch in (keep if sample else chains) for g, _ in ch)
    print(f"  {done:,} candidates: {priced:,} priced from {traced:,} traces in {seconds:,.0f} s "
          f"({seconds / max(done, 1):.2f} s a candidate, {jobs} job(s)); best: "
          f"{result['plans'][0]['mesh'] if result['plans'] else 'none fits'}", flush=True)
    if sample:
        print(f"  extrapolated (every candidate at that rate): {n * seconds / max(done, 1) / 60:,.0f} min, "
              f"target {target / 60:.0f} min", flush=True)
    else:
        print(f"  {'meets' if seconds <= target else 'misses'} the target: {seconds:,.0f} s of {target} s")


def check_case(name, preset, gpus, batch, layouts, folder) -> None:
    """``layouts`` layouts whose blocks the plan prices per block, priced that way and whole
    (the audit ``audit_args`` stand for): the differences in step time and peak."""
    from torchledger.audit.pipeline import RANK_PROCESS
    from torchledger.formulas.hardware import get_gpu
    from torchledger.plan import search as plan_search
    from torchledger.plan.evaluate import price_group, probe, warm
    from torchledger.plan.space import enumerate_space
    path = os.path.join(folder, f"{preset}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(MODEL.format(preset=preset))
    facts = probe(path)
    warm()
    RANK_PROCESS["start"] = "fork"
    space = enumerate_space(facts, gpus, batch, SEARCH["dims"], SEARCH["checkpointing"], SEARCH["schedules"],
                            gpus_per_node=get_gpu("h100").gpus_per_node)
    groups = [(g, d) for ch in plan_search.chains(space.candidates, facts) for g, d in ch if d]
    print(f"{name}: {len(groups):,} of the layouts' groups priced per block; checking {layouts}", flush=True)
    worst = [0.0, 0.0]
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    for group, depth in groups[::max(1, len(groups) // layouts)][:layouts]:
        # each pricing in a fresh fork, as the plan prices a chain: a pipeline's ranks fork
        # from a process that has made no world
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            t0 = time.perf_counter()
            short = pool.apply(price_group, (path, "audit_spec", "h100", gpus, group, depth))
            t1 = time.perf_counter()
            whole = pool.apply(price_group, (path, "audit_spec", "h100", gpus, group, None))
            t2 = time.perf_counter()
        for c, a, b in zip(group, short, whole):
            step, peak = a["step_seconds"] / b["step_seconds"] - 1, a["peak_bytes"] / b["peak_bytes"] - 1
            worst = [max(worst[0], abs(step)), max(worst[1], abs(peak))]
            print(f"  {c.mesh} B={c.micro_batch_size} {c.checkpointing} {c.schedule or '-'} v={c.virtual_stages}: "
                  f"step {b['step_seconds']:.4f} s {step:+.3%}, peak {b['peak_bytes'] / 2**30:.2f} GiB {peak:+.3%} "
                  f"(per block {t1 - t0:.1f} s, whole {t2 - t1:.1f} s)", flush=True)
    print(f"  worst: step {worst[0]:.3%}, peak {worst[1]:.3%} (the plan's bar: 2% and 1%)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=0, help="price only this many chains of each case")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--check", type=int, default=0, help="instead: this many layouts priced per block and whole")
    ap.add_argument("--case", type=int, choices=range(len(CASES)), default=None, help="run only this case")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for i, case in enumerate(CASES):
            if args.case is not None and args.case != i:
                continue
            if args.check:
                check_case(*case[:4], args.check, folder)
            else:
                run_case(*case, args.sample, args.jobs, folder)


if __name__ == "__main__":
    main()
