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
    bandwidth tables (``torchledger.formulas.interconnect``), never a measurement;
  - DDP (``DistributedDataParallel``) runs as in a real world with two pieces swapped while
    the world lasts (:func:`simulated_ddp`): the construction-time check that every rank's
    parameters have the same shapes (it reads values fake tensors do not have; simulated ranks
    are alike by construction) is skipped, and the gradient buckets are all-reduced by a
    Python comm hook doing the C++ default's work (divide by the group size, one
    ``all_reduce`` per bucket), because the fake group's futures carry no value and the C++
    hook refuses that; and its buckets are re-cut after the first backward that all-reduces,
    in the order its gradients became ready there, as the C++ reducer's rebuild cuts them
    (the first at 1 MiB when ``bucket_cap_mb`` is left at its default, the others at
    ``bucket_cap_mb``), by a new reducer instead of the C++ rebuild (which broadcasts the new
    assignment reading data fake tensors lack): from step 2 on the buckets hold the
    parameters real DDP's do, whatever order the modules were registered in (checked against
    real DDP over gloo). Before that, on step 1, the buckets are cut at those caps in reverse
    registration order (real DDP's first step all-reduces one bucket of everything).
    ``find_unused_parameters`` and ``static_graph`` do not run on fake tensors (DDP reads its
    used-parameter map). A comm hook the model file registers still runs (its future's value,
    None under the fake group, is replaced by the bucket).
"""
from __future__ import annotations

import contextlib
from typing import Optional

# the mesh parser lives with the layout parser (parallel imports nothing above it); its names
# are re-exported here for callers of ``torchledger.world``
from ..parallel.layout import MAX_WORLD, WorldError, mesh_dim_names, parse_layout, parse_mesh  # noqa: F401

__all__ = ["parse_mesh", "resolve_world", "fake_world", "mesh_dim_names", "SIMULATED_DEVICES",
           "simulated_ddp"]

#: Devices a simulated world runs on (the fake process group moves no data: real tensors
#: would be read as if a collective had filled them).
SIMULATED_DEVICES = ("fake",)
def resolve_world(world_size: Optional[int], mesh, device: str) -> Optional[tuple]:
    """``(world_size, mesh_shape)`` of a simulated world, or None for a plain single-process
    audit (neither flag given). ``mesh`` alone implies the world size; both must agree."""
    if world_size is None and mesh is None:
        return None
    if isinstance(mesh, str) and "=" in mesh:       # named: dp=4,cp=2,tp=8,pp=9
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
        with _mesh_coordinates_real(), _rank_chunks_only(), simulated_ddp():
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


class _KeepBuckets:
    """DDP's reducer, but for ``_rebuild_buckets`` and ``prepare_for_backward``. After the first
    backward that all-reduces, the C++ reducer re-cuts its buckets in the order the gradients
    became ready in it (``Reducer::rebuild_buckets``: ``compute_bucket_assignment_by_size`` at
    ``dist._DEFAULT_FIRST_BUCKET_BYTES`` for the first bucket when ``bucket_cap_mb`` is left at
    its default, then ``bucket_cap_mb``) and broadcasts the new assignment from rank 0, reading
    the bucket tensors' data, which fake tensors do not have. Here ``ready`` (a
    :class:`_ReadyOrder`) notes that order and, at the same point (the next forward),
    :func:`_rebuild_in_ready_order` builds a reducer with those buckets; the C++ rebuild itself
    never runs. ``ready`` is None where the buckets are not rebuilt (:func:`_rebuilds`) and on
    the reducer that holds the rebuilt ones."""

    __slots__ = ("_reducer", "_ready")

    def __init__(self, reducer, ready=None):
        object.__setattr__(self, "_reducer", reducer)
        object.__setattr__(self, "_ready", ready)

    def _rebuild_buckets(self):
        ready = object.__getattribute__(self, "_ready")
        return ready is not None and ready.rebuild()

    def prepare_for_backward(self, *args, **kwargs):
        ready = object.__getattribute__(self, "_ready")
        if ready is not None:           # this backward all-reduces: its ready order is the one
            ready.arm()
        return object.__getattribute__(self, "_reducer").prepare_for_backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_reducer"), name)


class _ReadyOrder:
    """The order in which a DDP's parameters' gradients become ready in a backward that
    all-reduces (``arm``), noted by a post-accumulate-grad hook on each: it runs in the same
    autograd node, ``AccumulateGrad``, as the C++ reducer's own hook, so in the same order; it
    runs no op (nothing for the tracer to count) and changes no number. Indices are the
    reducer's (``_build_params_for_reducer``'s order). ``rebuild`` (the next forward) re-cuts
    the buckets once every parameter's gradient was seen, as the C++ reducer does, and takes
    the hooks off."""

    def __init__(self, ddp, params):
        import functools
        import weakref
        self.ddp = weakref.ref(ddp)
        self.n = len(params)
        self.order: dict = {}           # parameter index -> None, first ready first
        self.armed = False
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._seen, i))
                        for i, p in enumerate(params)]

    def _seen(self, index, param) -> None:
        if self.armed:
            self.order.setdefault(index)

    def arm(self) -> None:
        self.order.clear()
        self.armed = True

    def rebuild(self) -> bool:
        self.armed = False
        ddp = self.ddp()
        if ddp is None or len(self.order) != self.n:
            return False
        for h in self.handles:
            h.remove()
        _rebuild_in_ready_order(ddp, list(self.order))
        return True


def _rebuilds(ddp) -> bool:
    """Whether the simulated world re-cuts this DDP's buckets after its first backward: where
    the C++ reducer does (``should_rebuild_buckets``: never under ``find_unused_parameters``),
    but for ``static_graph`` (real DDP rebuilds after its second backward there, a fresh reducer
    would start its deferred first iteration over). Neither runs on fake tensors today (both
    read DDP's used-parameter map); nor do DDP's ``mixed_precision`` or an optimizer in
    backward on a CPU fake world."""
    return not ddp.find_unused_parameters and not ddp.static_graph


#: the ready order a rebuild cuts (``_rebuild_in_ready_order`` -> ``_ready_order_buckets``)
_REBUILDING: list = []


def _rebuild_in_ready_order(ddp, order: list) -> None:
    """DDP's buckets re-cut in ``order`` (parameter indices, first ready first): DDP's own
    reducer construction (``_ddp_init_helper``) with the assignment PyTorch's rebuild computes
    (``_ready_order_buckets`` hands it over), the simulated comm hook registered on the new
    reducer and its forward begun, as the old one's was. The old reducer (its buckets and its
    autograd hooks) goes first, as ``initialize_buckets`` clears the old buckets before it makes
    the new: the step's peak never holds both."""
    import torch.distributed as dist
    parameters, expect_sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    # the last references to the old reducer: DDP's wrapper (still on the caller's stack) and
    # its logger, which holds the reducer
    object.__setattr__(ddp.reducer, "_reducer", None)
    ddp.reducer = ddp.logger = None
    _REBUILDING.append(order)
    try:
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    finally:
        _REBUILDING.pop()
    reducer = ddp.reducer
    dist._register_comm_hook(reducer, ddp.__dict__["_torchledger_sim"], _simulated_hook)
    reducer.prepare_for_forward()
    ddp.reducer = _KeepBuckets(reducer)


class _SimulatedHook:
    """The one comm hook a simulated DDP registers with its reducer: the C++ default's work,
    or the hook the model file registers later (``target``)."""

    def __init__(self, group):
        self.group = group
        self.target = None          # (state, hook) of a Python hook, or "fp16" (builtin)


def _simulated_hook(sim, bucket):
    import torch
    import torch.distributed as dist
    buf = bucket.buffer()
    if isinstance(sim.target, tuple):
        state, hook = sim.target
        fut = hook(state, bucket)
        try:
            value = fut.wait()
        except Exception:  # noqa: BLE001  a hook chained on the fake group's None value
            value = None
        if isinstance(value, torch.Tensor) or (isinstance(value, list) and value
                                               and isinstance(value[0], torch.Tensor)):
            return fut
    else:
        n = dist.get_world_size(sim.group)
        if sim.target == "fp16":                    # FP16_COMPRESS: reduce in half precision
            half = buf.to(torch.float16).div_(n)
            dist.all_reduce(half, group=sim.group)
            buf.copy_(half)
        else:                                       # the default: average, one all-reduce
            buf.div_(n)
            dist.all_reduce(buf, group=sim.group)
    done = torch.futures.Future()
    done.set_result(buf)
    return done


@contextlib.contextmanager
def simulated_ddp():
    """While the world lasts, ``DistributedDataParallel`` builds and steps on fake tensors
    under the fake process group (see the module's known limitations); the originals are
    put back on the way out."""
    try:
        import torch.distributed as dist
        from torch.nn.parallel import distributed as ddp_mod
    except ImportError:             # pragma: no cover - a torch without distributed
        yield
        return
    with _ready_order_buckets(dist, ddp_mod), _simulated_ddp_class(dist, ddp_mod):
        yield


@contextlib.contextmanager
def _simulated_ddp_class(dist, ddp_mod):
    """DDP's constructor and comm-hook registration routed to the simulated hook, and its
    cross-rank shape check skipped; the originals put back on the way out."""
    DDP = ddp_mod.DistributedDataParallel
    saved = {"verify": ddp_mod.__dict__.get("_verify_param_shape_across_processes"),
             "__init__": DDP.__dict__["__init__"], "register_comm_hook": DDP.__dict__["register_comm_hook"],
             "_register_builtin_comm_hook": DDP.__dict__["_register_builtin_comm_hook"]}

    def sim_of(self):
        sim = self.__dict__.get("_torchledger_sim")
        if sim is None:
            sim = self.__dict__["_torchledger_sim"] = _SimulatedHook(self.process_group)
            reducer = self.reducer
            dist._register_comm_hook(getattr(reducer, "_reducer", reducer), sim, _simulated_hook)
        return sim

    def __init__(self, *args, **kwargs):
        saved["__init__"](self, *args, **kwargs)
        if getattr(self, "reducer", None) is not None:
            sim_of(self)
            ready = _ReadyOrder(self, self._build_params_for_reducer()[0]) if _rebuilds(self) else None
            self.reducer = _KeepBuckets(self.reducer, ready)

    def register_comm_hook(self, state, hook):
        sim_of(self).target = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type):
        sim_of(self).target = "fp16" if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS else None

    ddp_mod._verify_param_shape_across_processes = lambda *args, **kwargs: None
    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
    try:
        yield
    finally:
        if saved["verify"] is not None:
            ddp_mod._verify_param_shape_across_processes = saved["verify"]
        else:                           # another torch without it: leave nothing of ours behind
            ddp_mod.__dict__.pop("_verify_param_shape_across_processes", None)
        for name in ("__init__", "register_comm_hook", "_register_builtin_comm_hook"):
            setattr(DDP, name, saved[name])


@contextlib.contextmanager
def _ready_order_buckets(dist, ddp_mod):
    """DDP's buckets: at construction cut at the caps of its rebuild (the first at 1 MiB when
    ``bucket_cap_mb`` is left at its default, the others at ``bucket_cap_mb``) in reverse
    parameter order (real DDP starts with one bucket of everything); at the rebuild after the
    first backward (:func:`_rebuild_in_ready_order`) cut as ``Reducer::rebuild_buckets`` cuts
    them, in the order the gradients became ready. The originals put back on the way out."""
    config = getattr(ddp_mod, "_BucketCapacityConfig", None)
    limits = config.__dict__.get("compute_bucket_size_limits") if config is not None else None
    if limits is not None:
        def capped_limits(self, static_graph, find_unused_parameters):
            # the caps DDP's rebuild after the first step uses, from the start
            if self.has_custom_per_bucket_caps:
                return limits(self, static_graph, find_unused_parameters)
            first = [self.first_bucket_bytes_cap] if self.first_bucket_bytes_cap < self.bucket_bytes_cap else []
            return first + [self.bucket_bytes_cap], []
        config.compute_bucket_size_limits = capped_limits
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is not None:
        def by_ready_order(tensors, size_limits, expect_sparse=None, *args, **kwargs):
            if _REBUILDING:
                # the rebuild: PyTorch's own assignment of the tensors in the order their
                # gradients became ready (``tensor_indices``, as ``Reducer::rebuild_buckets``
                # passes them: buckets in the order they filled, not sorted), handed back
                # reversed for DDP's constructor to reverse again
                order = _REBUILDING[-1]
                buckets, caps = assign([tensors[i] for i in order], size_limits,
                                       list(expect_sparse or []), order)
                return list(reversed(buckets)), list(reversed(caps))
            # DDP's construction cuts in parameter order; the rebuild's order is not known yet:
            # cut in reverse parameter order (a backward's order when forward uses the modules
            # as they are registered), and hand the buckets back so that DDP's own reversal
            # leaves the first-ready first
            n = len(tensors)
            rev_sparse = list(reversed(expect_sparse)) if expect_sparse is not None else None
            buckets, caps = assign(list(reversed(tensors)), size_limits, rev_sparse, *args, **kwargs)
            buckets = [[n - 1 - i for i in b] for b in buckets]
            return list(reversed(buckets)), list(reversed(caps))
        dist._compute_bucket_assignment_by_size = by_ready_order
    try:
        yield
    finally:
        if limits is not None:
            config.compute_bucket_size_limits = limits
        if assign is not None:
            dist._compute_bucket_assignment_by_size = assign
