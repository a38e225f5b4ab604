"""Merge the records of the ranks of one distributed step: per-rank rows, skew, findings.

    >>> merged = merge_ranks([rec0, rec1], names=["rank0.json", "rank1.json"])
    >>> merged["skew"]["peak_bytes"]["max_over_median"]
    1.25
    >>> [f.rule for f in merged["findings"]]
    ['TL-RANK-001']

Pure: records in, a plain dict out (the shape of ``report --format json``, schema
``torchledger.ranks/1``). Findings that only a merge can make:

* TL-RANK-001 (warning): a rank's peak bytes more than ``rank_peak_skew`` (10%) above the
  median rank's. The job's memory limit is the largest rank's, so that rank sets it.
* TL-RANK-002 (warning): a rank's step time more than ``rank_time_skew`` (20%) above the
  median: a straggler; every collective waits for it.
* TL-RANK-003 (warning): FLOPs differ across ranks by more than ``rank_flops_skew`` (5%) of
  the smallest: uneven batches or shards; the ranks with less work wait for the one with most.
* TL-RANK-004 (warning): ranks of the run's world size have no record (``rank 1 of 2
  missing``): a rank that failed or was killed before saving; the skew covers the ranks given.
  :func:`lone_rank_findings` makes the same finding for one record of a multi-rank run.

Ranks that send and receive between pipeline stages (p2p ``send``/``recv`` in forward or
backward) hold different layers and do different work by design: TL-RANK-001 and TL-RANK-003
are not made for them (``pipeline_stages`` in the merge says so); stragglers still are.

Known limitations: ranks are compared with the median rank, so in a world of two the
median is their mean (a rank 25% above the other is 11% above the median). Step times of a
traced step include the tracer's overhead, alike on every rank.
"""
from __future__ import annotations

from statistics import median

from ..record import Finding
from ..units import fmt_bytes, fmt_count, printable

__all__ = ["merge_ranks", "lone_rank_findings", "RanksError", "SCHEMA", "DEFAULTS"]

SCHEMA = "torchledger.ranks/1"
#: Missing ranks listed by number (``missing_count`` counts them all).
MISSING_LISTED = 1024
#: Thresholds (fractions above the median, or of the smallest for FLOPs).
DEFAULTS = {"rank_peak_skew": 0.10, "rank_time_skew": 0.20, "rank_flops_skew": 0.05}
#: The quantities compared across ranks: (key in a row, how it prints).
SKEWED = (("flops", fmt_count), ("peak_bytes", fmt_bytes), ("comm_bytes", fmt_bytes),
          ("step_seconds", lambda s: f"{s:.3g} s"))


class RanksError(ValueError):
    """The records are not the ranks of one run; the message is one line."""


def merge_ranks(records, names=None, options=None) -> dict:
    """Rows per rank (sorted by rank), the skew of each quantity, the missing ranks and the
    findings of ``records`` (``StepRecord`` objects, the ranks of one step).

    ``names`` label the records in messages (file names); ``options`` may override
    :data:`DEFAULTS`. Raises :class:`RanksError` when the records are not ranks of one run:
    fewer than one, world sizes that differ, a rank given twice."""
    records = list(records)
    names = list(names) if names is not None else [f"record {i + 1}" for i in range(len(records))]
    shown = [printable(n) for n in names]         # messages are one line, whatever a file is called
    opts = {**DEFAULTS, **{k: v for k, v in (options or {}).items() if k in DEFAULTS}}
    world = _check_one_run(records, shown)
    rows = sorted((_row(r, n) for r, n in zip(records, names)), key=lambda row: row["rank"])
    skew = {key: _skew(rows, key) for key, _ in SKEWED}
    missing = _missing(rows, world)
    stages = any(_pipeline_stage(r) for r in records)
    return {"schema": SCHEMA, "world_size": world, "mesh": records[0].totals.get("mesh"),
            "ranks": rows, "missing_ranks": missing, "missing_count": world - len(rows),
            "skew": skew, "pipeline_stages": stages,
            "findings": _findings(rows, skew, opts, stages) + _missing_finding(rows, missing, world)}


def _pipeline_stage(record) -> bool:
    """The rank sends or receives between pipeline stages in its forward or backward."""
    return any(isinstance(c, dict) and c.get("op") in ("send", "recv") and c.get("phase") in ("forward", "backward")
               for c in getattr(record, "collectives", None) or ())


def lone_rank_findings(record, name: str = "the record") -> list:
    """TL-RANK-004 for one record of a real multi-rank run (``totals.world_size`` > 1, its
    other ranks not given): ``report rank0.json`` when rank 1 never wrote its record. A
    simulated world (``audit --world-size N``: rank 0 stands for every rank) makes none."""
    t = record.totals
    world = t.get("world_size", 1)
    if not isinstance(world, int) or world < 2 or ((record.meta or {}).get("audit") or {}).get("world_size"):
        return []
    return merge_ranks([record], names=[name])["findings"]


def _missing_finding(rows, missing, world: int) -> list:
    count = world - len(rows)
    if count <= 0:
        return []
    listed = ", ".join(str(r) for r in missing[:16]) + (", ..." if count > 16 else "")
    given = ", ".join(printable(row["file"]) for row in rows[:4]) + (", ..." if len(rows) > 4 else "")
    what = f"rank {listed} of {world} missing" if count == 1 else \
        f"{count:,} of {world:,} ranks missing (rank {listed})"
    return [Finding(
        "TL-RANK-004", "warning",
        f"{what}: no record of {'it' if count == 1 else 'them'} was given ({given}); the skew and "
        f"findings cover the {len(rows)} rank{'s' if len(rows) != 1 else ''} given",
        measured=len(rows), expected=world,
        hint="give every rank's file (torchledger report runs/rank*.json); a rank that failed or was "
             "killed before saving writes none: its log says why, and Ledger(save_to=...) saves each "
             "traced step as it ends")]


def _missing(rows, world: int) -> list:
    """The first :data:`MISSING_LISTED` ranks of ``world`` that no record has: a record's
    world size is input, and ``range(2**62)`` is not a list to build."""
    given = {row["rank"] for row in rows}
    out, rank = [], 0
    while rank < world and len(out) < MISSING_LISTED:
        if rank not in given:
            out.append(rank)
        rank += 1
    return out


def _check_one_run(records, names) -> int:
    if not records:
        raise RanksError("no records to merge; give the ranks' files: torchledger report rank0.json rank1.json ...")
    worlds = {}
    for rec, name in zip(records, names):
        worlds.setdefault(rec.totals.get("world_size", 1), name)
    if len(worlds) > 1:
        shown = ", ".join(f"{w} ({name})" for w, name in sorted(worlds.items()))
        raise RanksError(f"the records are not one run: world sizes differ: {shown}; "
                         f"give the records of one torchrun launch")
    meshes = {}
    for rec, name in zip(records, names):
        meshes.setdefault(str(rec.totals.get("mesh")), name)
    if len(meshes) > 1:
        shown = ", ".join(f"{m} ({name})" for m, name in meshes.items())
        raise RanksError(f"the records are not one run: meshes differ: {shown}; give the records of one "
                         f"torchrun launch")
    seen = {}
    for rec, name in zip(records, names):
        rank = rec.totals.get("rank", 0)
        if rank in seen:
            (world,) = worlds
            why = (" (records of single-process steps are all rank 0 of 1; trace each rank under torchrun)"
                   if world == 1 else "")
            raise RanksError(f"rank {rank} given twice: {seen[rank]} and {name}{why}")
        seen[rank] = name
    (world,) = worlds
    return world


def _row(rec, name) -> dict:
    t = rec.totals
    comm = t.get("comm_bytes")
    return {"rank": t.get("rank", 0), "file": name,
            "flops": (t.get("flops") or {}).get("total", 0), "peak_bytes": t.get("peak_bytes", 0),
            "param_bytes": t.get("param_bytes", 0), "grad_bytes": t.get("grad_bytes", 0),
            "optimizer_state_bytes": t.get("optimizer_state_bytes", 0),
            "comm_bytes": comm.get("total") if isinstance(comm, dict) else None,
            "step_seconds": t.get("step_seconds"), "tokens": t.get("tokens", 0)}


def _skew(rows, key) -> dict:
    """max, min, median and their ratios over the ranks that have ``key`` (None: none do)."""
    have = [(row[key], row["rank"]) for row in rows if row.get(key) is not None]
    if not have:
        return {"max": None, "min": None, "median": None, "max_rank": None, "min_rank": None,
                "max_over_min": None, "max_over_median": None, "ranks": 0}
    values = [v for v, _ in have]
    hi, lo, mid = max(values), min(values), median(values)
    return {"max": hi, "min": lo, "median": mid,
            "max_rank": next(r for v, r in have if v == hi), "min_rank": next(r for v, r in have if v == lo),
            "max_over_min": hi / lo if lo else None, "max_over_median": hi / mid if mid else None,
            "ranks": len(have)}


def _findings(rows, skew, opts, stages: bool = False) -> list:
    out = []
    if len(rows) < 2:
        return out
    peak, time, flops = skew["peak_bytes"], skew["step_seconds"], skew["flops"]
    for row in [] if stages else rows:                    # each rank above the median, by rank
        if peak["median"] and row["peak_bytes"] > peak["median"] * (1 + opts["rank_peak_skew"]):
            out.append(Finding(
                "TL-RANK-001", "warning",
                f"rank {row['rank']}'s peak {fmt_bytes(row['peak_bytes'])} is "
                f"{_above(row['peak_bytes'], peak['median'])} the median rank's {fmt_bytes(peak['median'])}: "
                f"the job needs memory for its largest rank",
                location=None, measured=row["peak_bytes"], expected=peak["median"],
                hint="uneven shards (parameters not divisible by the world size), a rank-0-only buffer "
                     "(logging, eval, checkpoint gather), or batches of uneven length"))
    for row in rows:
        secs = row["step_seconds"]
        if secs is not None and time["median"] and secs > time["median"] * (1 + opts["rank_time_skew"]):
            out.append(Finding(
                "TL-RANK-002", "warning",
                f"rank {row['rank']} is a straggler: its step took {secs:.3g} s, "
                f"{_above(secs, time['median'])} the median rank's {time['median']:.3g} s; "
                f"every collective waits for the slowest rank",
                measured=secs, expected=time["median"],
                hint="uneven data or work on that rank, a slower or shared device, or rank-0-only work "
                     "(logging, checkpointing) inside the step"))
    if not stages and flops["min"] is not None and flops["max"] > flops["min"] * (1 + opts["rank_flops_skew"]):
        out.append(Finding(
            "TL-RANK-003", "warning",
            f"FLOPs differ across ranks: rank {flops['max_rank']} did {fmt_count(flops['max'])}, "
            f"rank {flops['min_rank']} {fmt_count(flops['min'])} ({flops['max'] / max(flops['min'], 1):.3g}x); "
            f"the ranks with less work wait for the one with most",
            measured=flops["max"], expected=flops["min"],
            hint="give every rank the same tokens per step (pack or bucket sequences by length; "
                 "drop_last=True in the DistributedSampler's DataLoader)"))
    return out


def _above(value, reference) -> str:
    return f"{(value / reference - 1) * 100:.0f}% above"
