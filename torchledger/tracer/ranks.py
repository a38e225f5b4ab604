"""Which rank of which world a traced step ran on: ``totals.rank``, ``world_size``, ``mesh``.

    >>> rank_totals()                       # no process group
    {'rank': 0, 'world_size': 1, 'mesh': None}
    >>> rank_totals(mesh)                   # under torchrun, init_device_mesh("cuda", (2, 4))
    {'rank': 5, 'world_size': 8, 'mesh': [2, 4]}

The mesh is, first that applies: the ``mesh`` the user gave ``trace``/``Ledger`` (a
``DeviceMesh`` or a shape), the mesh of the model's DTensor parameters (FSDP2 ``fully_shard``,
tensor parallelism), ``[world_size]`` when a default process group is up, else ``None``.

Known limitations: the rank is the default group's; a step run in a sub-group (pipeline
stage, expert group) is still named by its global rank. A model whose parameters live on
different meshes (2-D TP + FSDP applied to some layers only) reports the first DTensor's.
"""
from __future__ import annotations

__all__ = ["rank_totals", "mesh_shape"]

_NOT_DISTRIBUTED = {"rank": 0, "world_size": 1, "mesh": None}


def rank_totals(mesh=None, model=None) -> dict:
    """``{"rank", "world_size", "mesh"}`` of the current process; never raises (a failure
    gives the single-process answer: a tracer must not break the step it observed)."""
    try:
        return _detect(mesh, model)
    except Exception:  # noqa: BLE001  (a half-torn-down process group, an odd mesh object)
        return dict(_NOT_DISTRIBUTED, mesh=_shape(mesh) if _is_shape(mesh) else None)


def _detect(mesh, model) -> dict:
    import torch.distributed as dist
    up = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if up else (0, 1)
    shape = _shape(mesh) if mesh is not None else _param_mesh(model)
    if shape is None and up:
        shape = [world]
    return {"rank": int(rank), "world_size": int(world), "mesh": shape}


def _param_mesh(model):
    """The mesh shape of the first DTensor parameter of ``model``, or None."""
    if model is None or not hasattr(model, "parameters"):
        return None
    for p in model.parameters():
        device_mesh = getattr(p, "device_mesh", None)
        if device_mesh is not None:
            return _shape(device_mesh)
    return None


def _is_shape(mesh) -> bool:
    return isinstance(mesh, (list, tuple)) and all(isinstance(n, int) and n > 0 for n in mesh)


def mesh_shape(mesh):
    """``mesh`` as the list ``totals.mesh`` holds (None stays None); a ``TypeError`` naming
    what arrived for anything that is neither a ``DeviceMesh`` nor a shape. For ``trace()``
    and ``Ledger()`` to refuse a bad ``mesh=`` before the step, not after it."""
    return None if mesh is None else _shape(mesh)


def _shape(mesh):
    """A ``DeviceMesh`` (or a shape: ``(8, 8)``) as a list of ints."""
    if _is_shape(mesh):
        return [int(n) for n in mesh]
    shape = getattr(mesh, "shape", None)              # DeviceMesh.shape: a tuple of ints
    if shape is None and hasattr(mesh, "mesh"):
        shape = tuple(mesh.mesh.shape)
    if shape is None:
        raise TypeError(f"mesh: expected a DeviceMesh or a shape such as (8, 8), got {type(mesh).__name__}")
    return [int(n) for n in shape]
