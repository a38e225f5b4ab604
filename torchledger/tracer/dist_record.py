"""The distributed part of a record: its collectives and the bytes this rank sends per phase
(zeros in a single process). Where the rank sits (rank, world size, mesh): :mod:`.ranks`.
Collectives the step issued through ``torch.distributed`` that the dispatch mode did not see
are named in ``record.warnings`` (``dist_memory`` counts the calls).
"""
from __future__ import annotations

from .phases import BACKWARD, FORWARD, OPTIMIZER, OTHER, PHASES, RECOMPUTE

__all__ = ["add_collectives"]

#: totals.comm_bytes's phases; recomputation (activation checkpointing) runs inside backward,
#: so the all-gathers it repeats count there.
_COMM_PHASE = {FORWARD: "forward", BACKWARD: "backward", RECOMPUTE: "backward",
               OPTIMIZER: "optimizer", OTHER: "other"}


def add_collectives(rec, mode, scope) -> None:
    """``rec.collectives`` (one row per op, group size, phase, module and source line,
    largest first) and ``totals.comm_bytes`` (bytes this rank sends, per phase)."""
    comm = {"forward": 0, "backward": 0, "optimizer": 0, "other": 0, "total": 0}
    rows = []
    for (op, n, span, phase, mod, loc), (count, sent, received, algo, bus) in mode.collectives.items():
        comm[_COMM_PHASE[phase]] += sent
        comm["total"] += sent
        row = {"op": op, "bytes": sent, "group_size": n, "phase": PHASES[phase],
               "module": scope.name(mod), "location": loc, "count": count,
               "bytes_received": received, "algo_bytes": algo, "bus_bytes": bus}
        if span is not None:            # global ranks from the group's lowest to its highest
            row["group_span"] = span
        rows.append(row)
    rows.sort(key=lambda r: (-r["bytes"], r["op"], r["phase"], r["module"] or "", r["location"] or ""))
    rec.collectives = rows
    rec.totals["comm_bytes"] = comm
    _unseen(rec, getattr(mode, "api_calls", None) or {}, rows)


def _unseen(rec, api_calls: dict, rows: list) -> None:
    """Say so when the step called ``torch.distributed.<op>`` more often than the dispatch
    mode saw that collective: the difference moved bytes that ``comm_bytes`` leaves out."""
    seen: dict = {}
    for r in rows:
        seen[r["op"]] = seen.get(r["op"], 0) + r["count"]
    for op, calls in sorted(api_calls.items()):
        if calls > seen.get(op, 0):
            rec.warnings.append(
                f"collectives not seen: the step called torch.distributed {op} {calls} time(s) but the "
                f"dispatch mode saw {seen.get(op, 0)}; the bytes of the other {calls - seen.get(op, 0)} are "
                f"not in comm_bytes or collectives (issued with torch dispatch disabled, under another "
                f"mode's handler, or around the dispatcher); trace them outside that context to count them")
