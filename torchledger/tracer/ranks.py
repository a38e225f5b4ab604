"""Which rank of which world a traced step ran on: ``totals.rank``, ``world_size``, ``mesh``.

    >>> rank_totals()                       # no process group
    {'rank': 0, 'world_size': 1, 'mesh': None}
    >>> rank_totals(mesh)                   # under torchrun, init_device_mesh("cuda", (2, 4))
    {'rank': 5, 'world_size': 8, 'mesh': [2, 4]}

``layout`` (only for a distributed step or DTensor parameters): how the parameters are laid
out over the ranks, what the references of ``analyzers/compare.py`` and ``analyzers/comm.py``
take as given (:func:`layout_of`).

The mesh is, first that applies: the ``mesh`` the user gave ``trace``/``Ledger`` (a
``DeviceMesh`` or a shape), the mesh of the model's DTensor parameters (FSDP2 ``fully_shard``,
tensor parallelism), ``[world_size]`` when a default process group is up, else ``None``.

Known limitations: the rank is the default group's; a step run in a sub-group (pipeline
stage, expert group) is still named by its global rank. A model whose parameters live on
different meshes (2-D TP + FSDP applied to some layers only) reports the first DTensor's.
"""
from __future__ import annotations

__all__ = ["rank_totals", "mesh_shape", "layout_of"]

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
    out = {"rank": int(rank), "world_size": int(world), "mesh": shape}
    if up or shape is not None:
        layout = layout_of(model)
        if layout is not None:
            out["layout"] = layout
    return out


def layout_of(model):
    """How ``model``'s parameters lie over the ranks, read off PyTorch's own objects (FSDP2's
    ``FSDPParam``, a DTensor's placements, DDP's process group), or None for no model::

        {"shard_group": s,          # FSDP2's shard group (1 without FSDP)
         "replicate_group": r,      # HSDP's replicate group, DDP's group (1 without)
         "tp": t,                   # the largest tensor-parallel split of a parameter
         "param_dtype": str|None, "reduce_dtype": str|None,   # FSDP2 MixedPrecisionPolicy
         "shard_span": int, "replicate_span": int,  # their groups' spans of global ranks
         "shard_rank": int, "tp_rank": int,         # this rank's place in the FSDP and TP groups
         "params": [[global shape, tp, tp_dim, s, r, trainable, reshard, dtype bytes, count]]}

    One ``params`` row per distinct kind of parameter: ``tp`` ranks split dim ``tp_dim`` (-1:
    none), then FSDP2 splits dim 0 of that over ``s`` ranks (padding it to a multiple of s);
    ``reshard``: False for an FSDP group kept gathered from forward to backward
    (``reshard_after_forward=False``, FSDP2's root). Never raises: None when unreadable."""
    try:
        return _layout(model)
    except Exception:  # noqa: BLE001  (a torch whose FSDP internals moved: no layout, no reference)
        return None


def _size_of(group) -> int:
    try:
        return int(group.size())
    except Exception:  # noqa: BLE001
        return 1


def _tp_split(spec) -> tuple:
    """(ranks, dim) of the tensor-parallel split in a DTensor spec's Shard placements."""
    t, dim = 1, -1
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard():
            t *= int(spec.mesh.size(mesh_dim))
            dim = int(placement.dim)
    return t, dim


def _tp_rank(spec):
    """This rank's coordinate on the (first) mesh dim a DTensor spec shards over, or None."""
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard():
            coordinate = spec.mesh.get_coordinate()
            return int(coordinate[mesh_dim]) if coordinate is not None else None
    return None


def _layout(model):
    from .collectives import group_span
    if model is None or not hasattr(model, "modules"):
        return None
    rows: dict = {}
    seen: set = set()
    shard = replicate = tp = 1
    param_dtype = reduce_dtype = None
    ddp = 1
    group = getattr(model, "process_group", None)
    spans: dict = {}
    if type(model).__name__ == "DistributedDataParallel" and group is not None:
        ddp = _size_of(group)
        spans["replicate_span"] = group_span(group)

    def add(param, global_shape, t, tp_dim, s, r, reshard):
        nonlocal shard, replicate, tp
        seen.add(id(param))
        shard, replicate, tp = max(shard, s), max(replicate, r), max(tp, t)
        key = (tuple(int(d) for d in global_shape), t, tp_dim, s, r, bool(param.requires_grad),
               bool(reshard), int(param.element_size()) if hasattr(param, "element_size") else 4)
        rows[key] = rows.get(key, 0) + 1

    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group_ = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group_ is None:
            continue
        info = group_.mesh_info
        s = int(getattr(info, "shard_mesh_size", 1) or 1)
        r = int(getattr(info, "replicate_mesh_size", 1) or 1)
        reshard = group_.post_forward_mesh_info is not None
        if "shard_span" not in spans and s > 1:
            spans["shard_span"] = group_span(info.shard_process_group)
            spans["shard_rank"] = int(getattr(info, "shard_mesh_rank", 0) or 0)
        if "replicate_span" not in spans and r > 1:
            spans["replicate_span"] = group_span(info.replicate_process_group)
        mp = getattr(group_, "mp_policy", None)
        if mp is not None and param_dtype is None:
            param_dtype = str(mp.param_dtype).replace("torch.", "") if mp.param_dtype is not None else None
            rd = mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype
            reduce_dtype = str(rd).replace("torch.", "") if rd is not None else None
        for fp in group_.fsdp_params:
            param = fp.sharded_param
            spec = getattr(fp, "_unsharded_dtensor_spec", None)
            t, dim = _tp_split(spec) if spec is not None else (1, -1)
            if t > 1 and "tp_rank" not in spans:
                spans["tp_rank"] = _tp_rank(spec)
            add(param, param.shape, t, dim, s, r, reshard)
    for param in model.parameters():
        if id(param) in seen:
            continue
        spec = getattr(param, "_spec", None)
        t, dim = _tp_split(spec) if spec is not None else (1, -1)
        if t > 1 and "tp_rank" not in spans:
            spans["tp_rank"] = _tp_rank(spec)
        add(param, param.shape, t, dim, 1, ddp, True)
    if not rows:
        return None
    return {"shard_group": shard, "replicate_group": replicate, "tp": tp,
            "param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
            **{k: v for k, v in spans.items() if v is not None},
            "params": [[list(k[0]), *k[1:], n] for k, n in sorted(rows.items())]}


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
