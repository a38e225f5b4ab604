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
def fake_world(world_size: int, mesh_shape: tuple, rank: int = 0):
    """Rank ``rank`` of a fake process group of ``world_size`` ranks, and its CPU
    ``DeviceMesh`` (yielded). The process group is destroyed on the way out, whatever happens
    inside (an error, a KeyboardInterrupt): the next audit, or the user's own code in the same
    process, starts with none."""
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
        names = mesh_dim_names(len(mesh_shape))
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
        with _mesh_coordinates_real(), _rank_chunks_only():
            yield mesh
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()



class _Chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is asked for: FSDP2 reads this rank's chunk
    and chunk 0 of each parameter, and making all ``n`` views (twice per parameter) is what made
    a simulated world's setup grow with its size (1,024 ranks: 199 of 229 s)."""

    def __init__(self, tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        size = tensor.size(dim)
        self.step = -(-size // n)                            # torch.chunk's chunk size
        self.real = -(-size // self.step)                    # chunks torch.chunk returns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i >= self.real:
            return self[0].new_empty(0)
        start = i * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))

    def __iter__(self):
        return (self[i] for i in range(self.n))


@contextlib.contextmanager
def _rank_chunks_only():
    """While the world lasts, FSDP2 shards each parameter through ``_Chunks`` (the same views
    of the same sizes, made one at a time); put back on the way out."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:              # another torch: nothing to patch
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return

    def chunk_with_empty(tensor, num_chunks, dim):
        if tensor.dim() == 0 or tensor.size(dim) == 0 or num_chunks <= 1:
            return original(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


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
    try:
        yield
    finally:
        DeviceMesh._compute_coordinate_on_dim = original
