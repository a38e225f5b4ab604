"""Collectives seen by the dispatch mode: which ops they are and how many bytes they move.

``torch.distributed`` collectives are dispatcher ops (``c10d.allreduce_`` from DDP's reducer,
``c10d._allgather_base_`` and ``c10d._reduce_scatter_base_`` from FSDP2, ``_c10d_functional.*``
from DTensor and compiled code), so ``dispatch.LedgerMode`` sees every one issued outside an
op. Those a DTensor issues *inside* an op (sharding propagation redistributing an input: a
matmul of two ``Shard(0)`` operands all-gathers one; AdamW's foreach ops on ``Partial``
gradients all-reduce them) run while LedgerMode is popped for that op's own handler; for the
length of each DTensor op ``InnerCollectives`` sits on the mode stack and hands the
collectives of its desugaring to LedgerMode (PyTorch's ``CommDebugMode`` sees them the same
way: it lets DTensor desugar first, by answering ``NotImplemented`` for DTensor ops). Each becomes one
event, aggregated by (op, group size, phase, module, source line) into ``record.collectives``
and ``totals.comm_bytes``. Collectives are never FLOPs, never uncounted ops, never copies.

Bytes, per event (S_in: the bytes of the tensors this rank contributes, S_out: the bytes of
the tensors the collective fills on this rank, n: the group size):

=============== ======================= =================== ============ ============
op              ``bytes`` (sent)        ``bytes_received``  algo_bytes   bus factor
=============== ======================= =================== ============ ============
all_reduce      S (the buffer)          S                   S            2(n-1)/n
all_gather      S_in (the local shard)  S_out = n S_in      S_out        (n-1)/n
reduce_scatter  S_in (the full input)   S_out = S_in / n    S_in         (n-1)/n
broadcast       S                       S                   S            1
all_to_all      S_in                    S_out               S_in         (n-1)/n
send            S                       0                   S            1
recv            0                       S                   S            1
=============== ======================= =================== ============ ============

``algo_bytes`` and ``bus_bytes = algo_bytes x factor`` follow NCCL-tests' PERFORMANCE.md
(algbw = size / time, busbw = algbw x factor; the factor makes busbw comparable with the
link's bandwidth whatever n is): bus bytes are what a ring algorithm moves over each rank's
link. ``bytes`` is the logical payload this rank contributes, the figure ``totals.comm_bytes``
adds up. Hand check: all-reduce of 1,024 fp32 at n = 4: bytes 4,096, bus 4,096 x 2 x 3 / 4 =
6,144.

Known limitations: ``reduce``, ``gather`` and ``scatter`` (rooted, rare in training) keep
those names (beyond the seven of the record format) and are recorded with the root's view (sent =
input, received = output); bytes of a collective run asynchronously count when it is issued,
not when ``wait()`` returns; a collective whose process group cannot be resolved is not
recorded (the record's warnings name it: "op not recorded: ..."); collectives that never
reach the dispatcher (a compiled region's fused kernels, NCCL calls from C++ extensions) are
invisible to any dispatch mode: torch.compile'd steps are traced by ``tracer/compiled.py``.

Pipeline parallel (``torch.distributed.pipelining``): a schedule sends and receives a stage's
activations and gradients between its stage's forward and backward calls, outside any module
and any autograd node, and 1F1B fires one micro-batch's forward sends and the next one's
backward receives in one ``batch_isend_irecv``; the dispatch mode alone would put them all in
phase "other". ``pipeline_p2p_hook`` tags each ``P2POp`` the stage hands its schedule
(``get_fwd_recv_ops``/``get_fwd_send_ops``: forward; ``get_bwd_recv_ops``/
``get_bwd_send_ops``: backward) with its phase and the stage's module, and the send or receive
of that tensor is recorded there. Known limitation: the schedule's first-step set-up (the
stages' static/dynamic vote and their shape metadata, ``send_object_list``) stays in "other",
and the FLOPs of its metadata inference (on meta tensors) are counted: a first step's record
says so in its warnings.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..formulas.comm import bus_factor

__all__ = ["COLLECTIVES", "IGNORED", "lookup", "collective_bytes", "bus_factor", "describe",
           "InnerCollectives", "pipeline_p2p_hook", "p2p_tag", "PIPELINE_SETUP_WARNING"]

#: (namespace, op) -> (plain op name, index of the input argument(s), index of the output
#: argument(s) or None for the op's return value, index of the group argument, kind of group
#: argument: "pg" a boxed ProcessGroup, "name" a group name, "size" a group-size int before
#: the name). In-place c10d ops write into their input (all_reduce, broadcast) or into an
#: output argument.
_TABLE = {
    ("c10d", "allreduce_"): ("all_reduce", 0, 0, 1, "pg"),
    ("c10d", "allreduce_coalesced_"): ("all_reduce", 0, 0, 1, "pg"),
    ("c10d", "_allgather_base_"): ("all_gather", 1, 0, 2, "pg"),
    ("c10d", "allgather_"): ("all_gather", 1, 0, 2, "pg"),
    ("c10d", "allgather_coalesced_"): ("all_gather", 1, 0, 2, "pg"),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 1, 0, 2, "pg"),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1, 0, 2, "pg"),
    ("c10d", "reduce_scatter_"): ("reduce_scatter", 1, 0, 2, "pg"),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1, 0, 2, "pg"),
    ("c10d", "broadcast_"): ("broadcast", 0, 0, 1, "pg"),
    ("c10d", "alltoall_base_"): ("all_to_all", 1, 0, 2, "pg"),
    ("c10d", "alltoall_"): ("all_to_all", 1, 0, 2, "pg"),
    ("c10d", "send"): ("send", 0, None, 1, "pg"),
    ("c10d", "recv_"): ("recv", None, 0, 1, "pg"),
    ("c10d", "recv_any_source_"): ("recv", None, 0, 1, "pg"),
    ("c10d", "reduce_"): ("reduce", 0, 0, 1, "pg"),
    ("c10d", "gather_"): ("gather", 1, 0, 2, "pg"),
    ("c10d", "scatter_"): ("scatter", 1, 0, 2, "pg"),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0, None, 2, "name"),
    ("_c10d_functional", "all_reduce_"): ("all_reduce", 0, None, 2, "name"),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 0, None, 2, "name"),
    ("_c10d_functional", "all_reduce_coalesced_"): ("all_reduce", 0, None, 2, "name"),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0, None, 1, "size"),
    ("_c10d_functional", "all_gather_into_tensor_out"): ("all_gather", 0, None, 1, "size"),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", 0, None, 1, "size"),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0, None, 2, "size"),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0, None, 2, "size"),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0, None, 3, "name"),
    ("_c10d_functional", "broadcast"): ("broadcast", 0, None, 2, "name"),
    ("_c10d_functional", "broadcast_"): ("broadcast", 0, None, 2, "name"),
    ("_c10d_functional", "isend"): ("send", 0, "none", 3, "name"),
    ("_c10d_functional", "irecv"): ("recv", None, None, 3, "name"),
}
#: The autograd-aware functional collectives (DTensor's redistribute in backward) take the
#: same arguments as their ``_c10d_functional`` namesakes.
for (_ns, _name), _row in list(_TABLE.items()):
    if _ns == "_c10d_functional":
        _TABLE[("_c10d_functional_autograd", _name)] = _row

#: Ops of the collective machinery that move no data of their own: waits, barriers, the
#: autograd wrapper of a functional collective's output. Not recorded at all (not uncounted).
_IGNORED = {("_c10d_functional", "wait_tensor"), ("_c10d_functional", "_wrap_tensor_autograd"),
            ("_c10d_functional_autograd", "wait_tensor"), ("c10d", "barrier"),
            ("c10d", "monitored_barrier_"), ("c10d", "_wait_tensor"),
            # FSDP2's copy-in before an all-gather, copy-out after it and the padded gradient
            # concatenation before a reduce-scatter: the collective's own staging, not copies
            # of the user's (their buffers are tracked: see dist_memory)
            ("fsdp", "all_gather_copy_in"), ("fsdp", "split_with_sizes_copy"), ("fsdp", "chunk_cat")}
#: The op name under which ``LedgerMode.on_collective`` hears of FSDP's copy-out.
FSDP_COPY_OUT = "fsdp_copy_out"


def _resolve(table) -> dict:
    out = {}
    for (ns, name), row in table.items():
        packet = getattr(getattr(torch.ops, ns, None), name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            out[getattr(packet, overload)] = row
    return out


COLLECTIVES: dict = {}
"""func -> table row (see ``lookup``)."""
IGNORED: set = set()
"""The ops of ``_IGNORED`` that exist now."""


def lookup() -> set:
    """Resolve the table against the ops registered now (some, like ``_wrap_tensor_autograd``,
    are registered when ``torch.distributed._functional_collectives`` is first imported, so
    each trace looks again) and return the ids of every collective-machinery op."""
    try:
        import torch.distributed  # noqa: F401  registers the c10d ops
    except Exception:       # a torch built without distributed: no collective can run either
        pass
    # NB: ops are registered by imports: resolve again only when a module was imported since
    # the last time (a trace's fixed cost, not a walk of every op namespace per step)
    if _LOOKED_UP and _LOOKED_UP[0] == len(sys.modules):
        return _LOOKED_UP[1]
    COLLECTIVES.update(_resolve(_TABLE))
    IGNORED.update(_resolve({k: None for k in _IGNORED}))
    ids = frozenset({id(op) for op in COLLECTIVES} | {id(op) for op in IGNORED})
    _LOOKED_UP[:] = [len(sys.modules), ids]
    return ids


_LOOKED_UP: list = []       # [len(sys.modules) when resolved, the ids]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def collective_bytes(op: str, sent_in: int, filled: int, n: int) -> dict:
    """The four byte counts of one event (see the module's table). ``sent_in``: bytes of the
    input tensors, ``filled``: bytes of the tensors the collective fills on this rank."""
    if op == "all_reduce" or op == "broadcast":
        sent, received, algo = sent_in, sent_in, sent_in
    elif op == "all_gather" or op == "gather":
        sent, received, algo = sent_in, filled, filled
    elif op in ("reduce_scatter", "all_to_all", "scatter", "reduce"):
        sent, received, algo = sent_in, filled, sent_in
    elif op == "send":
        sent, received, algo = sent_in, 0, sent_in
    else:                               # recv
        sent, received, algo = 0, filled, filled
    num, den = bus_factor(op, n)
    return {"bytes": sent, "bytes_received": received, "algo_bytes": algo, "bus_bytes": algo * num // den}


def _group(arg, kind: str):
    """The process group a collective runs on."""
    if kind == "pg":
        from torch.distributed import ProcessGroup
        return ProcessGroup.unbox(arg)
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(arg)


def group_span(group):
    """``max - min + 1`` of the global ranks in ``group``: ranks placed node by node (torchrun's
    order), a group whose span fits one node talks over NVLink, else across nodes. None when
    the ranks cannot be read."""
    try:
        from torch.distributed import get_process_group_ranks
        ranks = get_process_group_ranks(group)
        return int(max(ranks) - min(ranks) + 1) if ranks else None
    except Exception:  # noqa: BLE001  (a group this build cannot describe)
        return None


def describe(func, args, kwargs, out) -> tuple:
    """(op, group size, group span, byte counts) of one collective call."""
    op, i_in, i_out, i_group, kind = COLLECTIVES[func]
    span = None
    if kind == "size":                  # the group size sits before the group name
        n = int(args[i_group])
        if i_group + 1 < len(args):
            try:
                span = group_span(_group(args[i_group + 1], "name"))
            except Exception:  # noqa: BLE001
                span = None
    else:
        group = _group(args[i_group] if i_group < len(args) else kwargs.get("group_name"), kind)
        n, span = int(group.size()), group_span(group)
    sent_in = _nbytes(args[i_in]) if i_in is not None else 0
    if i_out is None:                   # functional: the result is the op's return value
        filled = _nbytes(out) if op != "send" else 0
    elif i_out == "none":
        filled = 0
    else:
        filled = _nbytes(args[i_out])
    if op == "recv" and i_out is None:  # functional irecv fills (and returns) its argument
        filled = _nbytes(args[0])
    return op, n, span, collective_bytes(op, sent_in, filled, n)


class InnerCollectives(TorchDispatchMode):
    """On the mode stack for the length of one DTensor op that ``ledger`` (a LedgerMode) is
    running: lets DTensor desugar (``NotImplemented`` for ops on DTensors, as
    ``CommDebugMode`` does), and hands each collective of the desugared ops to
    ``ledger.inner_collective`` under the outer op's phase and module. Everything else passes
    through untouched: the outer op's FLOPs and bytes are LedgerMode's, counted once."""

    def __init__(self, ledger, phase, mod, is_wrapper):
        super().__init__()
        self.ledger, self.phase, self.mod, self.is_wrapper = ledger, phase, mod, is_wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if types and any(self.is_wrapper(t) for t in types):
            return NotImplemented       # DTensor first: its local ops and comms come back here
        out = func(*args, **kwargs)
        if id(func) in self.ledger.collective_ids:
            try:
                self.ledger.inner_collective(func, args, kwargs, out, self.phase, self.mod)
            except Exception as e:  # noqa: BLE001  a hook must never kill training
                self.ledger._error(func, e)
        return out


#: The stage methods that hand a schedule its p2p ops, and the phase of those ops.
_STAGE_P2P = {"get_fwd_recv_ops": "forward", "get_fwd_send_ops": "forward",
              "get_bwd_recv_ops": "backward", "get_bwd_send_ops": "backward"}


#: ``PipelineStage``'s first-step set-up: each stage's forward (and backward) once on meta
#: tensors, to learn the shapes it exchanges.
_STAGE_SETUP = ("_forward_metadata_inference", "_backward_metadata_inference")
PIPELINE_SETUP_WARNING = (
    "pipeline set-up traced: this step is a schedule's first, which runs PyTorch's stage "
    "metadata inference (each stage's forward, and backward, once on meta tensors) and exchanges "
    "the stages' shapes; its FLOPs are in this record's and its p2p in phase 'other', beyond the "
    "step's micro-batches: trace a later step (a Ledger's second) for the steady step")


def pipeline_p2p_hook(tags: dict, life, ours, module_index, warn) -> None:
    """For the trace, wrap the four methods of ``torch.distributed.pipelining``'s stages that
    make their ``P2POp`` lists: each op's tensor goes into ``tags`` (id -> (weakref, phase
    name, module index of the stage's ``submod`` via ``module_index``, or -1)); and the stage's
    first-step metadata inference, which ``warn`` s once (``PIPELINE_SETUP_WARNING``). Nothing
    is imported or patched unless the step's process imported ``torch.distributed.pipelining``
    (a step without pipeline stages is untouched). Calls on threads that are not the step's
    (``ours()`` false) go straight to the original."""
    stage_mod = sys.modules.get("torch.distributed.pipelining.stage")
    base = getattr(stage_mod, "_PipelineStageBase", None)
    if base is None:
        return
    for name, phase in _STAGE_P2P.items():
        original = getattr(base, name, None)
        if original is None:            # a torch whose stages make their ops elsewhere
            continue
        life.patch(base, name, _tagging(original, phase, tags, ours, module_index))
    stage_cls = getattr(stage_mod, "PipelineStage", None)
    warned = []
    for name in _STAGE_SETUP:
        original = stage_cls.__dict__.get(name) if stage_cls is not None else None
        if callable(original):
            life.patch(stage_cls, name, _noting(original, ours, warn, warned))


def _noting(original, ours, warn, warned: list):
    def setup(stage, *args, **kwargs):
        if ours() and not warned:
            warned.append(True)
            warn(PIPELINE_SETUP_WARNING)
        return original(stage, *args, **kwargs)
    setup.__wrapped__ = original
    setup.__name__ = original.__name__
    return setup


def _tagging(original, phase: str, tags: dict, ours, module_index):
    def make_ops(stage, *args, **kwargs):
        ops = original(stage, *args, **kwargs)
        if ours():
            try:
                mod = module_index(getattr(stage, "submod", None))
                for op in ops:
                    t = getattr(op, "tensor", None)
                    if isinstance(t, torch.Tensor):
                        tags[id(t)] = (weakref.ref(t), phase, mod)
            except Exception:  # noqa: BLE001  a hook must never kill training: the op stays in "other"
                pass
        return ops
    make_ops.__wrapped__ = original
    make_ops.__doc__ = original.__doc__
    make_ops.__name__ = original.__name__
    return make_ops


def p2p_tag(tags: dict, args):
    """(phase name, module index) of a send or receive whose tensor a stage tagged (the entry
    is used up), else None. ``args[0]``: the c10d op's tensor list (``send``/``recv_``) or the
    functional op's tensor."""
    first = args[0] if args else None
    t = first[0] if isinstance(first, (list, tuple)) and len(first) == 1 else first
    entry = tags.pop(id(t), None) if isinstance(t, torch.Tensor) else None
    if entry is None or entry[0]() is not t:
        return None
    return entry[1], entry[2]
