"""The distributed part of a record: its collectives and the bytes this rank sends per phase
(zeros in a single process). Where the rank sits (rank, world size, mesh): :mod:`.ranks`.
"""
from __future__ import annotations

from .dispatch import BACKWARD, FORWARD, OPTIMIZER, OTHER, PHASES, RECOMPUTE

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
