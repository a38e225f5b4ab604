"""The distributed part of a record: collectives, comm bytes per phase, and where this rank sits.

Filled only for a distributed step (a process group is initialised, or the step ran a
collective), so a single-process record keeps exactly the keys it had before.
"""
from __future__ import annotations

from .dispatch import BACKWARD, FORWARD, OPTIMIZER, OTHER, PHASES, RECOMPUTE

__all__ = ["add_collectives", "add_rank_fields", "is_distributed"]

#: totals.comm_bytes's phases; recomputation (activation checkpointing) runs inside backward,
#: so the all-gathers it repeats count there.
_COMM_PHASE = {FORWARD: "forward", BACKWARD: "backward", RECOMPUTE: "backward",
               OPTIMIZER: "optimizer", OTHER: "other"}


def is_distributed(mode) -> bool:
    if mode.collectives:
        return True
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def add_collectives(rec, mode, scope) -> None:
    """``rec.collectives`` (one row per op, group size, phase, module and source line,
    largest first) and ``totals.comm_bytes`` (bytes this rank sends, per phase)."""
    comm = {"forward": 0, "backward": 0, "optimizer": 0, "other": 0, "total": 0}
    rows = []
    for (op, n, phase, mod, loc), (count, sent, received, algo, bus) in mode.collectives.items():
        comm[_COMM_PHASE[phase]] += sent
        comm["total"] += sent
        rows.append({"op": op, "bytes": sent, "group_size": n, "phase": PHASES[phase],
                     "module": scope.name(mod), "location": loc, "count": count,
                     "bytes_received": received, "algo_bytes": algo, "bus_bytes": bus})
    rows.sort(key=lambda r: (-r["bytes"], r["op"], r["phase"], r["module"] or "", r["location"] or ""))
    rec.collectives = rows
    rec.totals["comm_bytes"] = comm


def add_rank_fields(rec, params=()) -> None:
    """``totals.rank``, ``totals.world_size`` and ``totals.mesh`` from the default process
    group; the mesh is the shape of the DeviceMesh the parameters are DTensors on (its root
    mesh: FSDP + TP on 8x8 gives [8, 8]), else of the current DeviceMesh, else null."""
    import torch.distributed as dist
    t = rec.totals
    if not (dist.is_available() and dist.is_initialized()):
        t["rank"], t["world_size"], t["mesh"] = 0, 1, None
        return
    t["rank"], t["world_size"] = dist.get_rank(), dist.get_world_size()
    t["mesh"] = _mesh_shape(params)


def _mesh_shape(params):
    try:
        for p in params:
            dm = getattr(p, "device_mesh", None)
            if dm is not None:
                root = dm._get_root_mesh() if hasattr(dm, "_get_root_mesh") else dm
                return [int(d) for d in root.mesh.shape]
        from torch.distributed.device_mesh import _mesh_resources
        if getattr(_mesh_resources, "mesh_stack", None):
            return [int(d) for d in _mesh_resources.get_current_mesh().mesh.shape]
    except Exception:           # a private API moved: no mesh rather than no record
        pass
    return None
