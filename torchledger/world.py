"""Simulated world sizes: ``torchledger audit FILE.py --world-size N [--mesh 8x8]``.

The step runs once, in this process, as rank 0 of ``N``: on fake tensors (no memory) under
PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``: every
collective returns at once without moving data, so shapes, shards and the collectives
issued are those of a real run) with a ``DeviceMesh`` of the given shape. The model file's
``AuditSpec(parallelize=fn)`` receives the model and that mesh and applies FSDP2
(``fully_shard``) and/or tensor parallelism (``parallelize_module``), PyTorch's own; nothing
here shards anything. Ranks of an SPMD step run the same ops on same-sized shards, so rank
0's record stands for each of them.

Mesh dimension names, for ``mesh["dp"]``-style indexing in ``parallelize``: one dim
``("dp",)``; two ``("dp", "tp")`` (``--mesh 8x8``: the last dim is the inner one, the ranks
of one node: TP inside 8, FSDP across 8); three ``("pp", "dp", "tp")``; more ``dim0..``.
A named mesh (``--mesh dp=4,cp=2,tp=8,pp=9``, :mod:`torchledger.parallel.layout`) has the
names it gives, outermost first in the order pp, dp_replicate, dp, cp, tp.

Known limitations:
  - only ``--device fake``: real or meta tensors at N ranks would need N processes
    (``torchrun``, then ``torchledger report rank*.json``);
  - ranks are assumed alike: uneven shards (a dim not divisible by the mesh) differ by a
    padding row between ranks, and rank 0 is the one reported;
  - the fake process group moves no data: communication *time* is an estimate from
    bandwidth tables (``torchledger.formulas.interconnect``), never a measurement.
"""
from __future__ import annotations

import contextlib
import re
from typing import Optional

__all__ = ["parse_mesh", "resolve_world", "fake_world", "mesh_dim_names", "SIMULATED_DEVICES"]

#: Devices a simulated world runs on (the fake process group moves no data: real tensors
#: would be read as if a collective had filled them).
SIMULATED_DEVICES = ("fake",)
MAX_WORLD = 1 << 20


class WorldError(ValueError):
    """A bad ``--world-size``/``--mesh``: one line for the user."""


def mesh_dim_names(ndim: int) -> tuple:
    """The names of a mesh's dims (see the module docstring)."""
    if ndim == 1:
        return ("dp",)
    if ndim == 2:
        return ("dp", "tp")
    if ndim == 3:
        return ("pp", "dp", "tp")
    return tuple(f"dim{i}" for i in range(ndim))


def parse_mesh(text) -> tuple:
    """``"8x8"`` -> ``(8, 8)``; ``"64"`` -> ``(64,)``. WorldError on anything else."""
    s = str(text).strip().lower().replace("×", "x").replace("*", "x").replace(",", "x")
    if not re.fullmatch(r"\d+(x\d+)*", s):
        raise WorldError(f"--mesh: expected dims joined by x, e.g. 8x8 or 64, got {text!r}")
    dims = tuple(int(d) for d in s.split("x"))
    if any(d < 1 for d in dims):
        raise WorldError(f"--mesh: every dim must be >= 1, got {text!r}")
    return dims


def resolve_world(world_size: Optional[int], mesh, device: str) -> Optional[tuple]:
    """``(world_size, mesh_shape)`` of a simulated world, or None for a plain single-process
    audit (neither flag given). ``mesh`` alone implies the world size; both must agree."""
    if world_size is None and mesh is None:
        return None
    if isinstance(mesh, str) and "=" in mesh:       # named: dp=4,cp=2,tp=8,pp=9
        from .parallel.layout import parse_layout
        mesh = parse_layout(mesh).shape
    shape = parse_mesh(mesh) if mesh is not None and not isinstance(mesh, tuple) else mesh
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise WorldError(f"--world-size: expected a whole number >= 1, got {world_size!r}")
        if world_size > MAX_WORLD:
            raise WorldError(f"--world-size: at most {MAX_WORLD:,} ranks, got {world_size:,}")
    product = 1
    for d in shape or ():
        product *= d
    if shape is not None and world_size is not None and product != world_size:
        raise WorldError(f"--mesh {'x'.join(map(str, shape))}: its dims multiply to {product}, not "
                         f"--world-size {world_size}; give dims whose product is {world_size} "
                         f"(or drop --world-size: the mesh implies it)")
    n = world_size if world_size is not None else product
    if n > MAX_WORLD:
        raise WorldError(f"--mesh: at most {MAX_WORLD:,} ranks, got {n:,}")
    if device not in SIMULATED_DEVICES:
        raise WorldError(f"--world-size {n} simulates {n} ranks on fake tensors under a fake process "
                         f"group; --device {device} cannot: drop --device (fake is the default), or "
                         f"run real ranks with torchrun and merge them with `torchledger report rank*.json`")
    return n, tuple(shape) if shape is not None else (n,)


@contextlib.contextmanager
def fake_world(world_size: int, mesh_shape: tuple, rank: int = 0, names: Optional[tuple] = None):
    """Rank ``rank`` of a fake process group of ``world_size`` ranks, and its CPU
    ``DeviceMesh`` (yielded). The process group is destroyed on the way out, whatever happens
    inside (an error, a KeyboardInterrupt): the next audit, or the user's own code in the same
    process, starts with none. ``names``: the mesh's dim names (default :func:`mesh_dim_names`;
    a named ``--mesh dp=4,tp=8`` gives its own)."""
    import torch.distributed as dist
    if not dist.is_available():
        raise WorldError("--world-size: this torch build has no torch.distributed; install a "
                         "torch with distributed support (the default pip wheels have it)")
    if dist.is_initialized():
        raise WorldError("--world-size: a process group is already initialised in this process; the "
                         "simulated world needs its own (call torch.distributed.destroy_process_group() "
                         "first, or run `torchledger audit` in a fresh process)")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:        # pragma: no cover - torch builds without the testing package
        raise WorldError(f"--world-size: torch's fake process group is missing ({e}); it ships "
                         f"with torch >= 2.2 (torch.testing._internal.distributed.fake_pg)") from None
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # NB: the mesh is made before any FakeTensorMode is entered: its rank tensor is real.
        names = tuple(names) if names else mesh_dim_names(len(mesh_shape))
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
        with _mesh_coordinates_real():
            yield mesh
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's sharding and redistribution caches: they hold meshes of this world
    (a DeviceMesh equals another of the same shape), whose groups are gone with it; the next
    world (another pipeline rank) would be handed them."""
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import DTensor
        prop = DTensor._op_dispatcher.sharding_propagator
        for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
            fn = getattr(prop, name, None)
            fn = getattr(fn, "cache", fn)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor import _redistribute
        fn = getattr(_redistribute, "_gen_transform_infos", None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()



@contextlib.contextmanager
def _mesh_coordinates_real():
    """While the world lasts, a ``DeviceMesh`` made inside a FakeTensorMode (a sub-mesh
    ``mesh["tp"]``, the dp x tp mesh FSDP2 concatenates for a TP-sharded parameter) finds its
    rank's coordinates on real tensors: torch computes them with ``nonzero``, which a fake
    mode cannot run (its output size depends on values). The rank map is a small real integer
    tensor, so this only undoes the fake mode for that lookup. The original method is put back
    on the way out."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    original = DeviceMesh.__dict__.get("_compute_coordinate_on_dim")
    if original is None:             # another torch: nothing to patch (slicing may then fail)
        yield
        return

    def coordinates(self):
        with unset_fake_temporarily():
            return original(self)

    DeviceMesh._compute_coordinate_on_dim = coordinates
    # the same for the rank's row of a mesh of three or more dims (FSDP2 under TP with pp or
    # cp in the mesh): torch finds it with ``nonzero`` too, on the rank map remapped
    mesh_of = DeviceMesh.__dict__.get("mesh")

    def mesh_tensor(self):
        with unset_fake_temporarily():
            return mesh_of.fget(self)

    if isinstance(mesh_of, property):
        DeviceMesh.mesh = property(mesh_tensor)
    try:
        yield
    finally:
        DeviceMesh._compute_coordinate_on_dim = original
        if isinstance(mesh_of, property):
            DeviceMesh.mesh = mesh_of
