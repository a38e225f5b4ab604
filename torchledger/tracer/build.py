"""Turn a finished tracer's raw counters into a plain ``StepRecord`` (runs once, after the step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np
import torch

from ..record import OPTIMIZER_SHARDS_ATTR, TOKENS_GIVEN, StepRecord
from .phases import BACKWARD, FORWARD, OPTIMIZER, OTHER, PHASES, RECOMPUTE
from .flops_attention import score_recompute_flops
from .memory import ACT, ALL_CATEGORIES, CATEGORIES, GRAD, UNSHARDED, state_tensors, tensor_bytes
from .modules import NO_MODULE
from .ranks import rank_totals
from .segments import op_namer, op_segments
from .cuda_history import UNAVAILABLE
from .shape import model_config

__all__ = ["build_record", "ATTENTION_KERNELS", "device_gpu"]

#: What each attention entry point is, for reports ("which kernel do these numbers describe").
ATTENTION_KERNELS = {
    "_scaled_dot_product_flash_attention_for_cpu": "CPU flash attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "CPU flash attention",
    "_scaled_dot_product_flash_attention": "CUDA flash attention",
    "_scaled_dot_product_flash_attention_backward": "CUDA flash attention",
    "_flash_attention_forward": "CUDA flash attention",
    "_flash_attention_backward": "CUDA flash attention",
    "_scaled_dot_product_efficient_attention": "memory-efficient attention",
    "_scaled_dot_product_efficient_attention_backward": "memory-efficient attention",
    "_efficient_attention_forward": "memory-efficient attention",
    "_efficient_attention_backward": "memory-efficient attention",
    "_scaled_dot_product_cudnn_attention": "cuDNN attention",
    "_scaled_dot_product_cudnn_attention_backward": "cuDNN attention",
    "_varlen_attn": "varlen attention (flash or cuDNN)",
    "_varlen_attn_out": "varlen attention (flash or cuDNN)",
    "_varlen_attn_backward": "varlen attention (flash or cuDNN)",
    "math": "SDPA math path (bmm + softmax)",
}
_MATMULISH = ("matmul", "attention")
_TIMELINE_POINTS = 400


def step_seconds(seconds, warnings: list, clock=None):
    """``seconds`` as a float when a clock could have measured it (finite, >= 0), else None
    with a warning: a ``trace(clock=...)`` that returns NaN or inf would write invalid JSON,
    and one that goes backwards a negative time that ``report`` refuses."""
    if seconds is None:
        return None
    try:
        value = float(seconds)
    except (TypeError, ValueError, OverflowError):
        value = float("nan")
    if value >= 0 and value != float("inf"):
        return value
    name = getattr(clock, "__qualname__", None) or type(clock).__name__
    warnings.append(f"step time left out: the clock ({name}) gave {seconds!r} s (expected a finite "
                    f"time >= 0; a clock that goes backwards or returns NaN/inf cannot time a step); "
                    f"pass a monotonic clock such as time.perf_counter")
    return None


def build_record(tracer, model, seconds: float, failed: bool = False) -> StepRecord:
    """The record of the step ``tracer`` watched, section by section. The order of the calls
    below is the order of the record's keys (the JSON and the golden reports depend on it)."""
    mode, scope = tracer.mode, tracer.scope
    n_mod = len(scope.names)
    rec = StepRecord()
    op_name = op_namer(mode.funcs)        # NB: str(OpOverload) formats its schema on every call
    flops = _add_flops(rec, mode, scope, op_name)
    _add_params(rec.totals, tracer, model)
    rec.uncounted_ops = _uncounted_ops(mode, scope)
    copies = _add_copies(rec, mode, scope, n_mod)
    act, recompute_saved = _add_activations(rec.totals, tracer, n_mod)
    rec.optimizer = _optimizer_summary(tracer._optimizers, tracer._params)
    rec.totals["optimizer_state_bytes"] = rec.optimizer.get("state_bytes", 0)
    mod_peak = _add_live_memory(rec, tracer, recompute_saved, op_name)
    rec.modules = _module_rows(scope, flops, act, copies, mod_peak)
    _add_time_meta_warnings(rec, tracer, model, seconds, failed, flops.model)
    _finish(rec, tracer, model)
    return rec


@dataclass
class _Flops:
    """What the FLOPs section hands to the module table."""
    model: int                  #: forward + backward + optimizer, the model's FLOPs
    by_module: np.ndarray       #: (modules + 1, phases); the last row: no module


@dataclass
class _OpTally:
    """The op table and its sums over every (phase, module, op) row the mode aggregated."""
    ops: list
    by_module: np.ndarray
    flops: list = field(default_factory=lambda: [0] * len(PHASES))
    causal: list = field(default_factory=lambda: [0] * len(PHASES))
    attn_dense: int = 0
    attn_causal: int = 0
    rescored: int = 0
    read: int = 0
    written: int = 0


def _tally_ops(mode, scope, op_name) -> _OpTally:
    """One row per (op, phase, module) with its FLOPs and bytes, and their sums by phase and by
    module, sorted by FLOPs (most first), then by name."""
    n_mod = len(scope.names)
    tally = _OpTally(ops=[], by_module=np.zeros((n_mod + 1, len(PHASES)), dtype=np.int64))  # last row: no module
    flop_at: dict = {}                  # (module row, phase) -> FLOPs, into by_module after the loop
    for (phase, mod, fid), (count, f, fc, r, w) in mode.agg_rows():
        func, kind = mode.funcs[fid], mode.kinds.get(fid)
        tally.flops[phase] += f
        tally.causal[phase] += fc
        tally.read += r
        tally.written += w
        if kind == "attention":
            if phase != RECOMPUTE:
                tally.attn_dense += f
                tally.attn_causal += fc
            if phase != FORWARD and phase != OTHER:   # fused backwards redo Q K^T: hardware only
                tally.rescored += score_recompute_flops(_kernel_name(func), f)
        at = (mod if mod >= 0 else n_mod, phase)
        flop_at[at] = flop_at.get(at, 0) + f
        tally.ops.append({"op": op_name(fid), "phase": PHASES[phase], "module": scope.name(mod),
                          "kind": kind if kind is not None else "uncounted", "count": count, "flops": f,
                          "flops_causal": fc, "bytes_read": r, "bytes_written": w})
    for (row, phase), f in flop_at.items():
        tally.by_module[row, phase] = f
    tally.ops.sort(key=itemgetter("op"))                  # by FLOPs, most first, then by name:
    tally.ops.sort(key=itemgetter("flops"), reverse=True)  # two stable sorts on C keys
    return tally


def _add_flops(rec, mode, scope, op_name) -> _Flops:
    """FLOPs and bytes by phase into ``rec.totals``, the op table into ``rec.ops`` (with its
    matmul/attention shapes)."""
    tally, t = _tally_ops(mode, scope, op_name), rec.totals
    flops, causal = tally.flops, tally.causal
    model_flops = flops[FORWARD] + flops[BACKWARD] + flops[OPTIMIZER]
    t["flops"] = {"forward": flops[FORWARD], "backward": flops[BACKWARD],
                  "optimizer": flops[OPTIMIZER], "total": model_flops, "other": flops[OTHER]}
    t["flops_causal"] = causal[FORWARD] + causal[BACKWARD] + causal[OPTIMIZER]
    # score_recompute: Q K^T that the flash/efficient/cuDNN backward kernels redo (2.5 x forward
    # in all where the model count has 2 x); in hardware_flops, not in the model's total
    t["attention_flops"] = {"dense": tally.attn_dense, "causal": tally.attn_causal,
                            "score_recompute": tally.rescored}
    t["hardware_flops"] = model_flops + flops[RECOMPUTE] + tally.rescored
    ew = mode.elementwise
    t["elementwise_flops"] = {"forward": ew[FORWARD], "backward": ew[BACKWARD], "recompute": ew[RECOMPUTE],
                              "optimizer": ew[OPTIMIZER], "other": ew[OTHER],
                              "total": ew[FORWARD] + ew[BACKWARD] + ew[OPTIMIZER]}
    t["bytes_read"], t["bytes_written"] = tally.read, tally.written
    t["view_ops"] = {PHASES[i]: n for i, n in enumerate(mode.views)}
    rec.ops = tally.ops
    try:                                # matmul/attention shapes, fusion chains (opshapes.py)
        from .opshapes import attach_shapes
        attach_shapes(mode, scope, rec.ops, op_name)
    except Exception as e:  # never cost the user the record
        rec.warnings.append(f"op shapes unavailable: {type(e).__name__}: {e}")
    return _Flops(model=model_flops, by_module=tally.by_module)


def _add_params(t: dict, tracer, model) -> None:
    """Parameters, gradients, buffers and tokens into the totals ``t``."""
    params, mode = tracer._params, tracer.mode
    t["params"] = sum(p.numel() for p in params)
    t["param_bytes"] = sum(_local_bytes(p) for p in params)         # this rank's shard of a DTensor
    t["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    t["trainable_param_bytes"] = sum(_local_bytes(p) for p in params if p.requires_grad)
    t["matmul_params"] = sum(tracer._param_storages[k] if k in tracer._param_storages
                             else mode.gathered_params[k] for k in mode.matmul_params)
    t["tensor_parallel"] = int(mode.tensor_parallel)     # 1 unless weights were split at their matmuls
    t["param_matmul_flops_forward"] = int(mode.param_matmul_flops)
    # the backward matmuls those need: one forward's worth per operand that requires grad
    # (2 x forward when weight and input both train: 6 x sum(P x rows) in all; frozen weights less)
    t["param_matmul_flops_grad"] = int(mode.param_grad_flops)
    t["grad_bytes"] = sum(_bytes(p.grad) for p in params if p.grad is not None)
    t["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers()) if model is not None else 0
    t["tokens"] = tracer.tokens or 0
    t["tokens_source"] = tracer.tokens_source or (TOKENS_GIVEN if tracer.tokens else None)


def _uncounted_ops(mode, scope) -> list:
    """Ops with no FLOP formula: count, phases, and the first five modules that ran them."""
    unc: dict = {}
    for (fid, phase, mod), count in mode.uncounted.items():
        func = mode.funcs[fid]
        u = unc.setdefault(_op_name(func), {"op": _op_name(func), "count": 0, "phases": [], "modules": []})
        u["count"] += count
        if PHASES[phase] not in u["phases"]:
            u["phases"].append(PHASES[phase])
        if len(u["modules"]) < 5 and scope.name(mod) not in u["modules"]:
            u["modules"].append(scope.name(mod))
    return sorted(unc.values(), key=lambda u: (-u["count"], u["op"]))


def _add_copies(rec, mode, scope, n_mod: int) -> tuple:
    """Copy events into ``rec.copies`` (most bytes first) and ``totals.copy_bytes``; returns
    the bytes and counts per module row (the last: no module)."""
    copy_bytes = np.zeros(n_mod + 1, dtype=np.int64)
    copy_count = np.zeros(n_mod + 1, dtype=np.int64)
    for (op, mod, phase, loc, reason), (count, nbytes, detail) in mode.copies.items():
        rec.copies.append({"op": op, "module": scope.name(mod), "phase": PHASES[phase], "location": loc,
                           "reason": reason, "count": count, "bytes": nbytes, **detail})
        copy_bytes[mod if mod >= 0 else n_mod] += nbytes
        copy_count[mod if mod >= 0 else n_mod] += count
    rec.copies.sort(key=lambda c: -c["bytes"])
    rec.totals["copy_bytes"] = int(copy_bytes.sum())
    return copy_bytes, copy_count


def _add_activations(t: dict, tracer, n_mod: int) -> tuple:
    """``activation_bytes`` (saved in forward) into the totals ``t``; returns them per module
    row (the last: no module) and the bytes saved again by recomputation."""
    act = np.zeros(n_mod + 1, dtype=np.int64)
    recompute_saved = 0
    for nbytes, mod, phase in tracer._saved.values():
        if phase == "forward":
            act[mod if mod >= 0 else n_mod] += nbytes
        else:
            recompute_saved += nbytes
    t["activation_bytes"] = int(act.sum())
    return act, recompute_saved


@dataclass
class _Live:
    """Live bytes per category after each op, and where they peaked."""
    tl: np.ndarray              #: (categories, ops + 1)
    cats: tuple                 #: the categories of tl's rows
    live: np.ndarray            #: tl summed over categories
    peak_idx: int
    op_phase: np.ndarray        #: phase of each op (ops + 1)
    op_mod: np.ndarray          #: module row of each op (ops + 1)


def _live_timeline(tracer) -> _Live:
    mode, n_ops = tracer.mode, tracer.mode.n_ops
    tl = tracer.storages.timeline(n_ops)                # (categories, n_ops + 1)
    cats = ALL_CATEGORIES if tl[UNSHARDED].any() else CATEGORIES    # FSDP's gathered params: when present
    live = tl.sum(axis=0)
    peak_idx = int(live.argmax()) if live.size else 0
    op_phase = np.asarray(mode.op_phase + [FORWARD], dtype=np.int64)[: n_ops + 1]
    op_mod = np.asarray(mode.op_module + [NO_MODULE], dtype=np.int64)[: n_ops + 1]
    return _Live(tl, cats, live, peak_idx, op_phase, op_mod)


def _add_peak_totals(t: dict, lv: _Live, scope, n_ops: int) -> None:
    """The peak, and where it fell, into the totals ``t``."""
    t["peak_bytes"] = int(lv.live[lv.peak_idx]) if lv.live.size else 0
    # gradients: the most alive at once (zero_grad(set_to_none=True) frees them by the end)
    t["grad_bytes_end"] = t["grad_bytes"]
    if lv.live.size:
        t["grad_bytes"] = max(t["grad_bytes"], int(lv.tl[GRAD].max()))
        # activation_bytes sums every storage saved during the step (all micro-batches); this
        # is the most alive at once, what gradient accumulation keeps down
        t["activation_bytes_peak"] = int(lv.tl[ACT].max())
    if n_ops and lv.peak_idx < n_ops:
        phase = lv.op_phase[lv.peak_idx]
        t["peak_phase"] = PHASES[phase]
        t["peak_module"] = ("(optimizer)" if phase == OPTIMIZER
                            else "(outside the model)" if phase == OTHER
                            else scope.name(int(lv.op_mod[lv.peak_idx])))


def _add_live_memory(rec, tracer, recompute_saved: int, op_name) -> np.ndarray:
    """The peak into ``rec.totals``, the memory section into ``rec.memory``; returns each module
    row's own peak (the last row: no module)."""
    mode, scope, n_ops, n_mod = tracer.mode, tracer.scope, tracer.mode.n_ops, len(tracer.scope.names)
    lv = _live_timeline(tracer)
    tl, cats, live, peak_idx, op_phase = lv.tl, lv.cats, lv.live, lv.peak_idx, lv.op_phase
    _add_peak_totals(rec.totals, lv, scope, n_ops)
    mod_peak = np.zeros(n_mod + 1, dtype=np.int64)
    if n_ops:
        np.maximum.at(mod_peak, np.where(lv.op_mod[:n_ops] >= 0, lv.op_mod[:n_ops], n_mod), live[:n_ops])
    rec.memory = {
        "peak_bytes": rec.totals["peak_bytes"],
        "peak_op_index": peak_idx,
        "peak_breakdown": {c: int(tl[i, peak_idx]) for i, c in enumerate(cats)} if live.size else {},
        "end_breakdown": {c: int(tl[i, -1]) for i, c in enumerate(cats)} if live.size else {},
        "phase_peaks": {PHASES[p]: int(live[:n_ops][op_phase[:n_ops] == p].max())
                        for p in range(len(PHASES)) if n_ops and (op_phase[:n_ops] == p).any()},
        "recompute_saved_bytes": int(recompute_saved),
        "timeline": _downsample(tl, op_phase, peak_idx, cats),
        "cuda": tracer._cuda_marks,
        "categories": list(cats),
        "note": "live bytes of storages the step allocates plus the model's parameters, buffers, "
                "gradients and optimizer state; inputs made before the step count once saved",
    }
    try:
        rec.memory.update(op_segments(mode, scope, op_name))
    except Exception as e:  # never cost the user the record
        rec.warnings.append(f"op segments unavailable: {type(e).__name__}: {e}")
    if tracer._output_caches:
        rec.memory["output_cache"] = _output_cache(tracer, op_phase, peak_idx)
    return mod_peak


def _module_rows(scope, flops: _Flops, act, copies: tuple, mod_peak) -> list:
    """One row per module, inclusive of its children, in ``named_modules()`` order; then a
    "(no module)" row when anything ran outside every module."""
    n_mod, mod_flops, (copy_bytes, copy_count) = len(scope.names), flops.by_module, copies
    own = {
        "params": np.asarray(scope.own_params + [0], dtype=np.int64),
        "flops_forward": mod_flops[:, FORWARD].copy(), "flops_backward": mod_flops[:, BACKWARD].copy(),
        "flops_recompute": mod_flops[:, RECOMPUTE].copy(),
        "activation_bytes": act, "copy_bytes": copy_bytes, "copies": copy_count,
    }
    incl = {k: v.tolist() for k, v in own.items()}     # NB: plain ints, not numpy scalars, per module
    peak_incl = mod_peak.tolist()
    for i in range(n_mod - 1, 0, -1):                   # children come after parents
        par = scope.parents[i]
        if par >= 0:
            for col in incl.values():
                col[par] += col[i]
            peak_incl[par] = max(peak_incl[par], peak_incl[i])
    total = max(flops.model, 1)
    flops_self = (own["flops_forward"] + own["flops_backward"]).tolist()
    rows = []
    for i, name in enumerate(scope.names):
        m = {"name": name, "type": scope.types[i], "depth": name.count(".") + 1 if name else 0,
             "calls": scope.calls[i]}
        m.update({k: v[i] for k, v in incl.items()})
        m["flops_self"] = flops_self[i]
        m["flops_share"] = (m["flops_forward"] + m["flops_backward"]) / total
        m["peak_bytes"] = peak_incl[i]
        rows.append(m)
    outside = int(mod_flops[n_mod, FORWARD] + mod_flops[n_mod, BACKWARD])
    if outside or act[n_mod] or copy_bytes[n_mod]:
        rows.append({"name": "(no module)", "type": "", "depth": 0, "calls": 0, "params": 0,
                     "flops_forward": int(mod_flops[n_mod, FORWARD]),
                     "flops_backward": int(mod_flops[n_mod, BACKWARD]),
                     "flops_recompute": int(mod_flops[n_mod, RECOMPUTE]),
                     "activation_bytes": int(act[n_mod]), "copy_bytes": int(copy_bytes[n_mod]),
                     "copies": int(copy_count[n_mod]), "flops_self": outside,
                     "flops_share": outside / total, "peak_bytes": int(mod_peak[n_mod])})
    return rows


def _add_time_meta_warnings(rec, tracer, model, seconds, failed: bool, model_flops: int) -> None:
    """Step time, rank and MFU into the totals; ``rec.meta``; ``rec.warnings``: the tracer's
    own, then the builder's so far (op shapes or segments unavailable)."""
    mode, t = tracer.mode, rec.totals
    seconds = step_seconds(seconds, tracer._warnings, getattr(tracer, "clock", None))
    t["step_seconds"] = seconds
    t.update(rank_totals(getattr(tracer, "mesh", None), model))     # rank, world_size, mesh
    if tracer.peak_flops and seconds:
        t["mfu"] = model_flops / seconds / float(tracer.peak_flops)
    rec.meta = _meta(tracer, model, mode, failed)
    # the builder's own warnings so far (op shapes or segments unavailable) stay after the tracer's
    rec.warnings = (list(tracer._warnings) + [f"op not recorded: {e}" for e in mode.errors]
                    + [w for w in rec.warnings if w not in tracer._warnings])
    if failed:
        rec.warnings.append("the step raised an exception: this record covers the ops before it")
    if tracer.seq_len:
        rec.meta["seq_len"] = tracer.seq_len
    elif (getattr(tracer, "seq_len_read", None) or (None,))[0]:   # read off the model's first call
        rec.meta["seq_len"], rec.meta["seq_len_source"] = tracer.seq_len_read


def _finish(rec, tracer, model) -> None:
    """Retention, the allocator and the collectives; then let go of the step's storages and
    parameters."""
    from .retention import retention
    try:
        retention(tracer, model, rec)
    except Exception as e:  # never cost the user the record
        rec.warnings.append(f"retention analysis failed: {type(e).__name__}: {e}")
    tracer.storages.release()
    rec.memory["allocator"] = _allocator(tracer)
    from .dist_record import add_collectives
    add_collectives(rec, tracer.mode, tracer.scope)   # totals.comm_bytes (zeros in one process), collectives
    tracer._params = []          # the step is over: hold no parameter (entering again re-reads them)


def _output_cache(tracer, op_phase, peak_idx: int) -> dict:
    """The key/value caches the model returned, and how much of them was live when it counted:
    at the step's peak, and when the optimizer step began (after backward nothing reads them)."""
    st, caches = tracer.storages, tracer._output_caches
    lifetimes = sorted({k for c in caches for k in c["lifetimes"]})
    opt_ops = np.flatnonzero(op_phase[:-1] == OPTIMIZER)

    def live_at(i: int) -> int:             # as in the timeline: alloc <= i < free
        return sum(st.nbytes[k] for k in lifetimes
                   if st.alloc[k] <= i and (st.free[k] < 0 or st.free[k] > i))

    first = caches[0]
    return {"field": first["field"], "cache_type": first["cache_type"], "forwards": len(caches),
            "tensors": sum(c["tensors"] for c in caches), "bytes": sum(c["bytes"] for c in caches),
            "bytes_at_peak": live_at(peak_idx),
            "bytes_at_optimizer": live_at(int(opt_ops[0])) if opt_ops.size else None}


def _allocator(tracer) -> dict:
    """Whether the CUDA caching allocator's history was recorded; the snapshot itself stays on
    the tracer (``tracer.snapshot``, with ``snapshot_marks`` and ``snapshot_device``) for the
    layer that summarises it (:func:`torchledger.analyzers.snapshot.allocator_view`)."""
    if tracer.history is None:
        reason = UNAVAILABLE if tracer.cuda is None else "allocator history was not recorded"
        return {"available": False, "reason": reason}
    try:
        snap = tracer.history.snapshot()
    except Exception as e:
        return {"available": False, "reason": f"allocator snapshot failed: {type(e).__name__}: {e}"}
    tracer.snapshot = snap
    tracer.snapshot_marks = list(tracer.mode.marks or [])
    tracer.snapshot_device = tracer.cuda.index or 0
    return {"available": True, "notes": list(tracer.history.notes)}


def _bytes(t) -> int:
    """Bytes of a tensor's data (a sparse one's indices and values); its dense size when its
    kind has no reachable data."""
    try:
        return tensor_bytes(t)
    except Exception:
        return t.numel() * t.element_size()


def _local_bytes(p) -> int:
    """Bytes of ``p`` on this rank: a DTensor's local shard (``to_local()``), else numel x size."""
    local = getattr(p, "_local_tensor", p)
    return local.numel() * local.element_size()


def _op_name(func) -> str:
    return str(func)


def _kernel_name(func) -> str:
    """An op's schema name without its namespace (``_flash_attention_backward``)."""
    schema = getattr(func, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def _downsample(tl: np.ndarray, op_phase: np.ndarray, peak_idx: int, cats=CATEGORIES) -> list:
    n = tl.shape[1]
    if n == 0:
        return []
    # the sorted, distinct sample points and the peak (NB: not np.unique, whose first call
    # imports numpy.ma, ~13 ms once per process)
    idx = np.sort(np.append(np.linspace(0, n - 1, min(n, _TIMELINE_POINTS)).astype(np.int64), peak_idx))
    idx = idx[np.append(True, idx[1:] != idx[:-1])]
    rows = []
    cols = tl[:, idx]                   # NB: one numpy gather, then plain ints (400 points a step)
    phases = op_phase[np.minimum(idx, len(op_phase) - 1)].tolist()
    for i, phase, col, total in zip(idx.tolist(), phases, cols.T.tolist(), cols.sum(axis=0).tolist()):
        row = {"op_index": i, "phase": PHASES[phase] if i < n - 1 else "end"}
        row.update(zip(cats, col))
        row["total"] = total
        rows.append(row)
    return rows


def _optimizer_summary(optimizers, params) -> dict:
    if not optimizers:
        return {}
    model_params = {id(p) for p in params}
    by_key: dict = {}
    n_opt_params = 0
    master = 0
    low_precision = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    names, kinds = [], []
    dtype_names: dict = {}
    shards = 1
    for opt in optimizers:
        names.append(type(opt).__name__)
        shards = max(shards, int(getattr(opt, OPTIMIZER_SHARDS_ATTR, 1) or 1))
        kinds.append(_optimizer_kind(opt))
        for group in opt.param_groups:
            for p in group["params"]:
                n_opt_params += p.numel()
                if id(p) not in model_params and p.dtype == torch.float32 and low_precision:
                    master += _bytes(p)          # a DTensor master: its local shard
        for key, v in state_tensors(opt):       # LBFGS's history lists too
            dtype = dtype_names.get(v.dtype)
            if dtype is None:
                dtype = dtype_names[v.dtype] = str(v.dtype).replace("torch.", "")
            e = by_key.get((key, dtype))
            if e is None:
                e = by_key[key, dtype] = {"key": key, "dtype": dtype, "tensors": 0, "numel": 0, "bytes": 0}
            e["tensors"] += 1
            e["numel"] += v.numel()
            e["bytes"] += _bytes(v)
    state_bytes = sum(e["bytes"] for e in by_key.values())
    dtypes = {p.dtype for p in params}
    precision = ("fp32" if dtypes == {torch.float32} else
                 "mixed" if master else "bf16" if dtypes <= {torch.bfloat16, torch.float16} else None)
    return {"names": names, "kind": kinds[0] if len(set(kinds)) == 1 else None, "precision": precision,
            "state": sorted(by_key.values(), key=lambda e: -e["bytes"]),
            "state_bytes": state_bytes, "params": n_opt_params,
            "bytes_per_param": state_bytes / n_opt_params if n_opt_params else None,
            "master_weight_bytes": master,
            **({"shards": shards} if shards > 1 else {}),
            "note": "state appears after the optimizer's first step" if not by_key else None}


_OPT_KINDS = {"AdamW": "adamw", "Adam": "adam", "Adagrad": "adagrad", "RMSprop": "rmsprop"}


def _optimizer_kind(opt):
    """The closed-form optimizer name (analyzers.memory.OPTIMIZERS) of a torch optimizer, or None."""
    name = type(opt).__name__
    if name == "SGD":
        return "sgd-momentum" if any(g.get("momentum", 0) for g in opt.param_groups) else "sgd"
    return _OPT_KINDS.get(name)


def _meta(tracer, model, mode, failed) -> dict:
    p = next(iter(tracer._params), None)
    if p is None:
        device, dtype = "cpu", None
    elif type(p).__name__ == "FakeTensor":
        device, dtype = f"fake ({p.device.type})", str(p.dtype).replace("torch.", "")
    else:
        device, dtype = p.device.type, str(p.dtype).replace("torch.", "")
    gpu = device_gpu(p.device) if p is not None and device == "cuda" else None
    kernels = sorted({ATTENTION_KERNELS.get(k, k) for k in mode.attention_kernels})
    try:
        config = model_config(model) if model is not None else None
    except Exception:            # an odd config must not cost the user the record
        config = None
    return {"device": device, "dtype": dtype, "torch": torch.__version__, "config": config,
            "model": type(model).__name__ if model is not None else None,
            "step_index": tracer.step_index, "ops": mode.n_ops,
            "attention_kernels": kernels or None, "failed": failed,
            "phases": sorted({PHASES[ph] for _, ph in mode.phase_changes}, key=PHASES.index),
            **({"gpu": gpu} if gpu else {}), **_gpu_kernels(tracer)}


def device_gpu(device):
    """The name of the GPU a real CUDA step ran on (``NVIDIA H100 80GB HBM3``: ``get_gpu``
    resolves it to its part), as ``meta.gpu``; None when it cannot be read. ``calibrate`` reads
    it to refuse records of another part than the one it fits."""
    try:
        name = torch.cuda.get_device_name(device)
    except Exception:            # a name we cannot read must not cost the user the record
        return None
    return name.strip() if isinstance(name, str) and name.strip() else None


def _gpu_kernels(tracer) -> dict:
    """``{"gpu_kernels": {name: {"calls", "note"}}}`` where a fake step ran a GPU kernel in place
    of CPU's path (``gpu_kernels.py``), else nothing."""
    applied = getattr(tracer, "gpu_kernels", None)
    if not applied:
        return {}
    from .gpu_kernels import KERNEL_NOTES
    return {"gpu_kernels": {k: {"calls": n, "note": KERNEL_NOTES[k]} for k, n in sorted(applied.items())}}
