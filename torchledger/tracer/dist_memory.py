"""Live memory of a sharded step: FSDP2's gathered parameters get their own category.

Under FSDP2 (``fully_shard``) a rank holds its parameters' local shards (DTensors: the
tracer counts ``to_local()``, see ``memory.data_tensors``). Before a module's forward and
again before its backward FSDP all-gathers them into one flat buffer (made by
``fsdp.all_gather_copy_in``), copies them out into per-parameter unsharded buffers
(``fsdp.split_with_sizes_copy``), and frees those after use by ``storage.resize_(0)`` and
re-allocates them by ``storage.resize_(n)``: the storage object lives on, so its lifetime
is not a weakref's. This module makes both buffers the category ``unsharded_params`` and
follows ``UntypedStorage.resize_`` while the step is traced.

Installed only when a process group is initialised (single-process steps are untouched).

The gathered weights a forward op saves for backward (a matmul's weight) are parameters, not
activations: the saved-tensor hook leaves every storage in ``gathered_params`` out of
``activation_bytes`` (as it leaves out the sharded parameters themselves).

Known limitations: any storage grown by ``resize_`` during a distributed step is counted as
unsharded parameters (FSDP is the one user of that idiom in PyTorch); the padded unsharded
gradients FSDP builds for the reduce-scatter (``fsdp.chunk_cat``) are temporaries.

Gradient accumulation under FSDP2 with a ``reduce_dtype`` (``set_requires_gradient_sync(False)``
between micro-batches, as a pipeline stage runs): FSDP2 moves each unsharded gradient out of
``.grad`` into ``FSDPParam.unsharded_accumulated_grad`` (upcast to the reduce dtype) and adds the
next micro-batches' into it until the last reduces it. Those are gradients: made so by
``to_accumulated_grad_if_needed`` here, and found at a step's start by :func:`accumulated_grads`.
"""
from __future__ import annotations

import os
import sys

import torch

from .memory import GRAD, TEMP, UNSHARDED, storages

__all__ = ["install_distributed", "accumulated_grads"]


def install_distributed(tracer, life) -> None:
    """Follow ``resize_`` and mark FSDP's gathered buffers, for a distributed step only."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return
    except Exception:
        return
    mode, tracker = tracer.mode, tracer.storages
    original = torch.UntypedStorage.resize_

    def resize_(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        try:
            if tracer._ours() and not tracker.closed:
                tracker.resized(self, UNSHARDED)
                if self.nbytes():
                    # FSDP2's unsharded parameter buffer grown back: at world size 1 FSDP
                    # copies the shard into it with no collective (no copy-out to see), so
                    # this is where its matmul weights (N of 6ND) are first known
                    mode.gathered_params.setdefault(self._cdata, 0)
        except Exception as e:              # never raise into the user's step
            tracer._warn(f"storage resize: {type(e).__name__}: {e}")
        return out

    resize_.__wrapped__ = original
    life.patch(torch.UntypedStorage, "resize_", resize_)

    def on_collective(op, func, args, kwargs, out) -> None:
        if op == "all_gather" and _from_fsdp():    # FSDP's flat buffer of gathered parameters
            target = args[0] if args and isinstance(args[0], torch.Tensor) else out
            if isinstance(target, torch.Tensor):
                for s in storages(target):
                    tracker.promote(s, UNSHARDED, only_from=TEMP)
        elif op == "fsdp_copy_out":         # the per-parameter unsharded buffers
            for t in kwargs.get("out") or ():
                for s in storages(t):
                    tracker.promote(s, UNSHARDED, only_from=TEMP)
                    # the unsharded parameter a matmul multiplies (N of 6ND): FSDP2 keeps one
                    # storage per parameter, resized to 0 and back, so a parameter counts once;
                    # its numel is read at the matmul (this buffer is padded to the world size)
                    mode.gathered_params.setdefault(s._cdata, 0)

    mode.on_collective = on_collective
    _follow_fsdp_outputs(tracer, life, mode, tracker)
    _follow_accumulated_grads(tracer, life, tracker)
    _count_api_calls(tracer, life, mode)


#: ``torch.distributed`` functions -> the collective they issue (the record format's plain names).
_API = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
        "broadcast": "broadcast", "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
        "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _count_api_calls(tracer, life, mode) -> None:
    """Count the step's ``torch.distributed.<collective>(...)`` calls (``mode.api_calls``), so
    that a collective that never reached the dispatch mode (issued with torch dispatch
    disabled, from under another mode's handler, by code that talks to the process group
    around the dispatcher) is named in ``record.warnings`` (``dist_record``) instead of
    silently missing from ``comm_bytes``."""
    import threading

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    mode.api_calls = {}
    # NB: the blocking p2p calls are built on the others (``send`` calls ``isend`` and waits,
    # ``recv`` calls ``irecv``): one user call is one collective, so a call made inside a
    # counted call is not counted again (per thread: autograd may run backward elsewhere)
    inside = threading.local()

    for name, op in _API.items():
        original = getattr(c10d, name, None)
        if original is None or not callable(original):
            continue

        def counted(*args, __original=original, __op=op, **kwargs):
            outer = not getattr(inside, "depth", 0)
            try:
                if outer and tracer._ours() and not mode.quiet:
                    mode.api_calls[__op] = mode.api_calls.get(__op, 0) + 1
            except Exception:  # noqa: BLE001  never raise into the user's step
                pass
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return __original(*args, **kwargs)
            finally:
                inside.depth -= 1

        counted.__wrapped__ = original
        counted.__name__ = getattr(original, "__name__", name)
        counted.__doc__ = getattr(original, "__doc__", None)
        for namespace in (c10d, dist):
            if getattr(namespace, name, None) is original:
                life.patch(namespace, name, counted)


def _follow_fsdp_outputs(tracer, life, mode, tracker) -> None:
    """FSDP2 makes each parameter's unsharded buffer in ``FSDPParam.init_all_gather_outputs``
    (its first unshard); at world size 1 it then copies the shard in with no collective and no
    copy-out, so the buffer is known here or nowhere."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:             # another torch: the copy-out and resize_ paths remain
        return
    original = FSDPParam.__dict__.get("init_all_gather_outputs")
    if original is None:
        return

    def init_all_gather_outputs(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        try:
            if tracer._ours() and not tracker.closed:
                for t in getattr(self, "all_gather_outputs", ()) or ():
                    for s in storages(t):
                        tracker.promote(s, UNSHARDED, only_from=TEMP)
                        mode.gathered_params.setdefault(s._cdata, 0)
        except Exception as e:              # never raise into the user's step
            tracer._warn(f"FSDP unsharded buffers: {type(e).__name__}: {e}")
        return out

    init_all_gather_outputs.__wrapped__ = original
    life.patch(FSDPParam, "init_all_gather_outputs", init_all_gather_outputs)


def _follow_accumulated_grads(tracer, life, tracker) -> None:
    """FSDP2's accumulated unsharded gradient (see the module's docstring): a gradient."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:             # another torch: they stay temporaries
        return
    original = FSDPParam.__dict__.get("to_accumulated_grad_if_needed")
    if original is None:
        return

    def to_accumulated_grad_if_needed(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        try:
            grad = getattr(self, "unsharded_accumulated_grad", None)
            if grad is not None and tracer._ours() and not tracker.closed:
                for s in storages(grad):
                    tracker.promote(s, GRAD, only_from=None)
        except Exception as e:              # never raise into the user's step
            tracer._warn(f"FSDP accumulated gradients: {type(e).__name__}: {e}")
        return out

    to_accumulated_grad_if_needed.__wrapped__ = original
    life.patch(FSDPParam, "to_accumulated_grad_if_needed", to_accumulated_grad_if_needed)


def accumulated_grads(model) -> list:
    """The unsharded gradients FSDP2 accumulates for ``model``'s ``fully_shard`` units between
    micro-batches (``FSDPParam.unsharded_accumulated_grad``), those that exist now."""
    out = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            state = get_state()
        except Exception:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()) or ():
                grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                if grad is not None:
                    out.append(grad)
    return out


_FSDP_DIR = os.path.join("distributed", "fsdp", "")


def _from_fsdp(depth: int = 40) -> bool:
    """The collective was issued by ``torch.distributed.fsdp`` code (some caller frame is
    FSDP's): its all-gathers gather parameters (DTensor's all-gather activations too)."""
    f = sys._getframe(2)
    while f is not None and depth > 0:
        if _FSDP_DIR in f.f_code.co_filename:
            return True
        f, depth = f.f_back, depth - 1
    return False
