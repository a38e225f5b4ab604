"""Per-op facts the step-time model needs and the (phase, module, op) totals lack: the
shapes of each matmul and attention call, and where elementwise chains begin and end.

Gathered by ``dispatch.LedgerMode._record`` (``note_op`` for matmul-class and attention
ops; elementwise chains inline, see ``close_chain``) and read once by ``build.build_record``;
everything lives in the mode's :class:`ShapeLog`:

* matmul-class and attention ops: a signature, cached by (op, operand shapes), aggregated by
  (phase, module, op, signature) into count and FLOPs. Matmul: ``[batch, m, n, k]`` and the
  dtype (mm, addmm, bmm, baddbmm, _scaled_mm; convolution as its implicit GEMM); attention:
  ``[b, hq, sq, sk, d, dv]``, causal, dtype (the SDPA, flash, efficient and cuDNN ops,
  forward and backward). Ops with no signature (the SDPA math path's bmm, a convolution
  backward) are priced from their row's FLOPs and bytes instead.
* memory-bound ops (every other op that reads or writes bytes): elementwise *chains*, runs of
  them in one phase with no matmul, attention or collective between. A compiler fuses a
  chain into one kernel that reads the chain's input once and writes its output once: each
  row gets ``fused_bytes`` (the first op's bytes read plus the last op's bytes written, on the
  rows where chains start and end) and ``fused_kernels`` (chains started at that op).

Rows of ``record.ops`` gain ``shapes: [{"mnk"|"attn": [...], "dtype", "causal"?, "count",
"flops"}]`` and ``fused_bytes``/``fused_kernels`` (records stay torchledger/1: new keys only).
An attention call given an explicit mask adds ``"mask": true`` and ``"mask_bytes"`` (the storage
of the mask the kernel got: SDPA's CPU kernel gets a float copy of a boolean mask, made per
call and kept for backward), and ``"mask_causal"`` (the evidence, a few words) when
:mod:`.attn_masks` takes the mask for the causal one a GPU run would not build (``"causal"``
stays what the traced kernel was told: its ``is_causal``).

Known limitations: a fused chain's external inputs beyond its first op (a residual added
mid-chain) are not counted; shapes of DTensor operands are this rank's local shards.
"""
from __future__ import annotations

import torch

from .phases import PHASES
from .segments import op_namer

__all__ = ["ShapeLog", "note_op", "note_mask", "close_chain", "attach_shapes"]

_Tensor = torch.Tensor
_aten = torch.ops.aten
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp32"}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = "fp8"
_MM = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten.bmm.default: (0, 1),
       _aten.baddbmm.default: (1, 2)}
if hasattr(_aten, "_scaled_mm"):
    _MM[_aten._scaled_mm.default] = (0, 1)
_CONV = {_aten.convolution.default}


class ShapeLog:
    """What one traced step gathers for the step-time model (see the module doc)."""

    __slots__ = ("sigs", "cache", "fuse", "chain", "masked")

    def __init__(self):
        self.sigs: dict = {}    # (phase, mod, fid, signature) -> [count, flops]
        self.cache: dict = {}   # (fid, operand shapes, dtype) -> signature or None
        self.masked: dict = {}  # (that key, mask state) -> an attention op's signature (note_mask)
        self.fuse: dict = {}    # (phase, mod, fid) -> [fused bytes, chains started]
        self.chain = None       # [phase, key of the last op, its bytes written] of the open chain


_INNER: dict = {}   # tensor class -> it keeps its data in an inner ``_local_tensor`` (DTensor)


def _shape(t):
    """``t``'s shape; a DTensor's is its local shard's."""
    cls = type(t)
    inner = _INNER.get(cls)
    if inner is None:
        inner = _INNER[cls] = hasattr(cls, "__tensor_flatten__") and hasattr(cls, "_local_tensor")
    return tuple(t._local_tensor.shape if inner else t.shape)


def _matmul_sig(func, args):
    ia, ib = _MM[func]
    a, b = args[ia], args[ib]
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 2:
        return ("mnk", (1, sa[0], sb[1], sa[1]), _DTYPES.get(a.dtype, "fp32"))
    return ("mnk", (sa[0], sa[1], sb[2], sa[2]), _DTYPES.get(a.dtype, "fp32"))


def _conv_sig(args):
    x, w = args[0], args[1]
    sx, sw = _shape(x), _shape(w)
    groups = int(args[8]) if len(args) > 8 else 1
    out_spatial = 1
    # implicit GEMM: m = N x output pixels, n = C_out / groups, k = C_in / groups x kernel
    # volume; output pixels from the input's (stride-1, padded) size, an approximation
    for s in sx[2:]:
        out_spatial *= s
    kvol = 1
    for s in sw[2:]:
        kvol *= s
    return ("mnk", (groups, sx[0] * out_spatial, sw[0] // max(groups, 1), sw[1] * kvol),
            _DTYPES.get(x.dtype, "fp32"))


def _attn_sig(func, args, causal, mask=None):
    name = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else ""
    if "attention" not in name:
        return None
    off = 1 if name.endswith("_backward") else 0
    q, k, v = args[off], args[off + 1], args[off + 2]
    sq, sk, sv = _shape(q), _shape(k), _shape(v)
    if len(sq) != 4 or len(sk) != 4:
        return None
    if name.startswith(("_flash_attention", "_efficient_attention")):   # (b, s, h, d)
        b, s_q, hq, d = sq
        s_k, dv = sk[1], sv[3]
    else:                                                                 # (b, h, s, d)
        b, hq, s_q, d = sq
        s_k, dv = sk[2], sv[3]
    sig = ("attn", (b, hq, s_q, s_k, d, dv), _DTYPES.get(q.dtype, "fp32"), bool(causal))
    return sig if mask is None else sig + (mask,)


def note_mask(log, fid, func, args, fc, mask) -> None:
    """Called by ``dispatch`` for each fused attention op (never for others) before
    ``note_op``: the signature ``note_op`` finds in its cache for this call is made to carry
    ``mask``, the call's :meth:`~.attn_masks.MaskFacts.state` (None: no explicit mask; the
    signature is then the plain one). The cache key is ``note_op``'s own, which holds no mask
    (it is a keyword argument of the CPU kernel): so the matmuls' hot path pays nothing."""
    ckey = (fid, tuple(_shape(a) if isinstance(a, _Tensor) else None for a in args[:4]),
            fc.flops_causal < fc.flops)
    mkey = (ckey, mask)
    sig = log.masked.get(mkey, False)
    if sig is False:
        try:
            sig = _attn_sig(func, args, ckey[2], mask)
        except Exception:       # an op with an unexpected layout: priced from its row
            sig = None
        log.masked[mkey] = sig
    log.cache[ckey] = sig


def note_op(log, fid, func, args, phase, mod, fc) -> None:
    """Record one matmul-class or attention op's signature in ``log`` (it closes the open
    elementwise chain: a matmul ends a fusible run)."""
    if log.chain is not None:
        close_chain(log)
    shapes = tuple(_shape(a) if isinstance(a, _Tensor) else None for a in args[:4])
    ckey = (fid, shapes, fc.flops_causal < fc.flops)
    sig = log.cache.get(ckey, False)
    if sig is False:
        try:
            if func in _MM:
                sig = _matmul_sig(func, args)
            elif func in _CONV:
                sig = _conv_sig(args)
            elif fc.kind == "attention":
                sig = _attn_sig(func, args, ckey[2])
            else:
                sig = None
        except Exception:       # an op with an unexpected layout: priced from its row
            sig = None
        log.cache[ckey] = sig
    if sig is not None:
        key = (phase, mod, fid, sig)
        row = log.sigs.get(key)
        if row is None:
            row = log.sigs[key] = [0, 0]
        row[0] += 1
        row[1] += fc.flops


def close_chain(log) -> None:
    """End the open elementwise chain: its last op's row gets the bytes it wrote. (Chains are
    opened and extended by ``dispatch.LedgerMode._record`` itself, the hot path: each memory-
    bound op either extends the chain open in its phase (``chain = [phase, its row key, bytes
    written]``) or closes it and starts one, adding its bytes read and one kernel to
    ``fuse[its row key]``.)"""
    phase, key, written = log.chain
    log.chain = None
    row = log.fuse.get(key)
    if row is None:
        row = log.fuse[key] = [0, 0]
    row[0] += written


def attach_shapes(mode, scope, ops: list, op_name=None) -> None:
    """Add ``shapes``, ``fused_bytes`` and ``fused_kernels`` to the record's op rows.
    ``op_name(fid)`` is the name ``build`` gave the rows (default: ``str`` of the op).

    A shape (``mnk``, ``attn``) is the signature's own tuple of ints (a list in JSON): CPython
    stops tracking such a tuple at the first collection that sees it, and the entry dict
    holding it is then made untracked, so a 7B step's ~700 entries add nothing to what each
    full collection walks (a list per entry did: benchmarks/record_gc.py)."""
    log = mode.__dict__.get("shape_log")
    if log is None:
        return
    if op_name is None:
        op_name = op_namer(mode.funcs)
    if log.chain is not None:
        close_chain(log)
    rows = {(o["phase"], o["module"], o["op"]): o for o in ops}
    funcs = mode.funcs

    def row_of(phase, mod, fid):
        return rows.get((PHASES[phase], scope.name(mod), op_name(fid))) if fid in funcs else None

    for (phase, mod, fid, sig), (count, flops) in log.sigs.items():
        row = row_of(phase, mod, fid)
        if row is None:
            continue
        entry = {sig[0]: sig[1], "dtype": sig[2], "count": count, "flops": int(flops)}
        if sig[0] == "attn":
            entry["causal"] = sig[3]
            if len(sig) > 4:                # an explicit mask (attn_masks.MaskFacts.state)
                entry["mask"] = True
                entry["mask_bytes"] = sig[4][1]
                if sig[4][0]:
                    entry["mask_causal"] = sig[4][0]
        row.setdefault("shapes", []).append(entry)
    for (phase, mod, fid), (nbytes, kernels) in log.fuse.items():
        row = row_of(phase, mod, fid)
        if row is not None:
            row["fused_bytes"] = row.get("fused_bytes", 0) + int(nbytes)
            row["fused_kernels"] = row.get("fused_kernels", 0) + int(kernels)
