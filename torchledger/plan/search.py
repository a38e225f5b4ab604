"""``torchledger plan``'s search: enumerate the candidates (:mod:`.space`), price each chain
in a forked child (:mod:`.evaluate`; ``jobs`` at once), rank what fits by predicted step time
and say what separates each from the best. The result is the JSON of INTERFACE's "Plan"."""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

from .evaluate import audit_args, depths, probe, run_chain, warm
from .space import DEFAULT_CHECKPOINTING, DEFAULT_DIMS, DEFAULT_SCHEDULES, enumerate_space
from ..audit.loading import stdout_to_stderr
from ..audit.pipeline import RANK_PROCESS
from ..formulas.hardware import get_gpu

__all__ = ["search", "rank", "versus_best", "chains", "DEFAULT_MAX_MEMORY", "DEFAULT_TOP"]

DEFAULT_MAX_MEMORY = 0.9
DEFAULT_TOP = 10


def chains(candidates, facts=None) -> list:
    """The candidates as :mod:`.evaluate`'s chains: grouped by everything but the micro-batch
    split and the schedule, each chain [(group, depth)] in rising micro-batch size, a group the
    schedules of one micro-batch size (traced once), ``depth`` how deep to trace it
    (:func:`.evaluate.depths`; None: whole, also without ``facts``)."""
    found: dict = {}
    for c in candidates:
        key = (c.dims, c.checkpointing, c.virtual_stages, c.precision, c.kernels, c.sequence_parallel)
        found.setdefault(key, {}).setdefault(c.micro_batch_size, []).append(c)
    return [[(g, depths(facts, g[0]) if facts is not None else None) for _, g in sorted(by_b.items())]
            for by_b in found.values()]


def _chain_in_child(args):
    path, entry, gpu, gpus, chain, limit = args
    RANK_PROCESS["start"] = "fork"      # this child has made no world: its ranks fork from it
    with stdout_to_stderr():
        return run_chain(path, entry, gpu, gpus, chain, limit)


def _priced(work, jobs: int, progress):
    """Each chain's rows, chains run ``jobs`` at a time, each in a fresh forked child."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(max(1, jobs), maxtasksperchild=1) as pool:
        for rows in pool.imap_unordered(_chain_in_child, work):
            progress(rows)
            yield from rows


def search(path: str, gpu: str, gpus: int, global_batch: int, *, entry: str = "audit_spec",
           dims=DEFAULT_DIMS, checkpointing=DEFAULT_CHECKPOINTING, schedules=DEFAULT_SCHEDULES,
           precision: str = "bf16-mixed", kernels: str = "eager", max_memory: float = DEFAULT_MAX_MEMORY,
           top: int = DEFAULT_TOP, jobs: int = 1, stderr=None, virtual_stages=None, fixed=None,
           sequence_parallel=None) -> dict:
    """Search the layouts of ``path``'s model on ``gpus`` x ``gpu`` for ``global_batch``
    sequences a step; the plan as INTERFACE's JSON (plus ``candidates``: every priced row,
    for the HTML chart). ``virtual_stages`` and ``fixed`` narrow or widen the space
    (:func:`.space.enumerate_space`); ``sequence_parallel``: every layout's
    ``--sequence-parallel`` (None: the plan's default for the model). AuditError on a model the
    plan cannot search."""
    t0 = time.perf_counter()
    part = get_gpu(gpu)
    limit = max_memory * part.memory_bytes
    facts = probe(path, entry, sequence_parallel)
    warm()
    space = enumerate_space(facts, gpus, global_batch, dims, checkpointing, schedules, precision, kernels,
                            part.gpus_per_node, virtual_stages, fixed, sequence_parallel)
    rejected = Counter(space.rejected)
    work = [(path, entry, gpu, gpus, chain, limit) for chain in chains(space.candidates, facts)]
    counts = Counter()
    out = stderr if stderr is not None else sys.stderr

    def progress(rows):
        counts["traced"] += sum(r["audits"] for r in rows)
        counts["composed"] += sum(r["figures"] is not None for r in rows)
        counts["done"] += len(rows)
        out.write(f"\rtorchledger plan: {counts['done']}/{len(space.candidates)} candidates, "
                  f"{counts['traced']} traced, {counts['composed']} composed, "
                  f"{sum(rejected.values()) + counts['done'] - counts['composed']} rejected")
        out.flush()

    rows = list(_priced(work, jobs, progress))
    out.write("\n")
    priced = []
    for row in rows:
        c = row["candidate"]
        if row["error"]:
            rejected[f"the audit refused it: {row['error'][:160]}"] += 1
        elif row["skipped"]:
            rejected["does not fit: a smaller micro-batch of the layout did not (not traced)"] += 1
        else:
            fits = row["figures"]["peak_bytes"] <= limit
            if not fits:
                rejected[f"does not fit {max_memory:g} of {part.name}'s memory"] += 1
            priced.append(dict(_row(c, global_batch), **row["figures"], fits=fits))
    plans = rank(priced)[:top]
    return {"plans": plans, "rejected": dict(rejected), "searched": len(space.candidates) + sum(space.rejected.values()),
            "traced": counts["traced"], "composed": counts["composed"], "seconds": round(time.perf_counter() - t0, 3),
            "file": path, "gpu": part.name, "gpu_flag": gpu, "gpus": gpus, "global_batch": global_batch, "memory_limit_bytes": int(limit),
            "candidates": priced}


def _row(c, global_batch: int) -> dict:
    return {"mesh": c.mesh, "virtual_stages": c.virtual_stages, "micro_batch_size": c.micro_batch_size,
            "micro_batches": c.micro_batches, "checkpointing": c.checkpointing, "precision": c.precision,
            "kernels": c.kernels, "schedule": c.schedule, "audit_args": audit_args(c, global_batch)}


def rank(priced: list) -> list:
    """Fitting rows by predicted step time (then peak, then mesh); when none fits, the rows by
    peak (the nearest to fitting first). Each gets ``versus_best``."""
    fitting = sorted((r for r in priced if r["fits"]), key=lambda r: (r["step_seconds"], r["peak_bytes"], r["mesh"]))
    if not fitting:
        ranked = sorted(priced, key=lambda r: (r["peak_bytes"], r["step_seconds"], r["mesh"]))
        for r in ranked:
            r["versus_best"] = "does not fit"
        return ranked
    best = fitting[0]
    for r in fitting:
        r["versus_best"] = versus_best(r, best)
    return fitting


#: The parts of a predicted step that one layout can have more of than another.
PARTS = (("comm_exposed_seconds", "exposed communication"), ("bubble_seconds", "pipeline bubble"),
         ("recompute_seconds", "recomputation"), ("compute_seconds", "compute"),
         ("launch_seconds", "kernel launches"))


def versus_best(row: dict, best: dict) -> str:
    """What separates ``row`` from ``best``, from their numbers: the step's extra share and the
    part of the step that grew the most (``"+7%: exposed communication 2.1x the best's"``)."""
    if row is best:
        return "best"
    extra = row["step_seconds"] / best["step_seconds"] - 1 if best["step_seconds"] else 0.0
    head = f"{extra:+.0%}" if abs(extra) >= 0.005 else f"{extra:+.1%}"     # a faster row: "-2%"
    growth = [row.get(k, 0.0) - best.get(k, 0.0) for k, _ in PARTS]
    # the first part within 1% of the largest growth: recomputation (a share of the compute)
    # is named before the compute it grew, whichever rounding left a hair larger
    key, name = next(p for p, g in zip(PARTS, growth) if g >= max(growth) - 0.01 * abs(max(growth)))
    mine, theirs = row.get(key, 0.0), best.get(key, 0.0)
    if mine - theirs <= 0:
        return f"{head}: no part larger than the best's"
    if theirs > 0:
        return f"{head}: {name} {mine / theirs:.1f}x the best's ({mine * 1e3:.3g} vs {theirs * 1e3:.3g} ms)"
    return f"{head}: {name} {mine * 1e3:.3g} ms, the best has none"


def default_jobs() -> int:
    """One chain per core, at most."""
    return max(1, min(os.cpu_count() or 1, 8))
