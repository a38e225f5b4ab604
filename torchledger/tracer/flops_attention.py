"""Attention FLOP formulas: the handlers of every SDPA entry point (the math, flash,
efficient, cuDNN and fused-overrideable ``_scaled_dot_product_*`` ops and their backwards) and
of the ``_flash``/``_efficient``/``_cudnn_attention_forward``/``_backward`` kernels, including
varlen (packed) sequences given by cumulative offsets. Attention is counted dense,
2*B*Hq*Sq*Sk*(Dqk + Dv) with the query heads, halved in ``flops_causal`` when the kernel is
causal and doubled for backward (model FLOPs, the 6ND convention); the conventions and
limitations are in :mod:`.flops`, which builds each handler once per op from ``ATTENTION_OPS``
(aten) and ``VARLEN`` (``torch.nn.attention.varlen``'s custom ops) and caches it.

What the kernels execute (``totals.hardware_flops``): the flash, memory-efficient and cuDNN
backward kernels keep no score matrix, so they recompute Q K^T first: five score-sized
matmuls, 2.5 x forward (PyTorch's ``FlopCounterMode`` counts them so), where the model count
has four. ``RECOMPUTING_BACKWARD`` names them; the math path's backward is plain bmm (2 x).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["RECOMPUTING_BACKWARD", "score_recompute_flops", "ATTENTION_OPS", "attention_flops"]

_new = tuple.__new__  # NB: ~3x faster than FlopCount(...), whose __new__ parses keywords


def _is_concrete(t) -> bool:
    """A plain tensor with data (not meta, fake or functional)."""
    return type(t) is torch.Tensor and t.device.type != "meta"


def _varlen_pairs(cu_q, cu_k, max_q, max_k, total_q: int, total_k: int) -> int:
    """sum_i Sq_i * Sk_i over the packed sequences given by cumulative offsets."""
    if cu_k is not None and _is_concrete(cu_q) and _is_concrete(cu_k):
        oq, ok = cu_q.tolist(), cu_k.tolist()  # NB: a host sync on CUDA
        return sum((oq[i + 1] - oq[i]) * (ok[i + 1] - ok[i]) for i in range(len(oq) - 1))
    bounds = [total_q * total_k]  # no data: the tightest upper bound the shapes allow
    if max_k is not None:
        bounds.append(total_q * int(max_k))
    if max_q is not None:
        bounds.append(int(max_q) * total_k)
        if max_k is not None:
            bounds.append((cu_q.shape[0] - 1) * int(max_q) * int(max_k))
    return min(bounds)


def attention_flops(func, getter, count, layout: str, backward: bool, causal: str = "is_causal",
               cum: Optional[tuple] = None, paged: Optional[str] = None) -> Callable[[tuple, dict, Any], Any]:
    """Build the handler of one SDPA entry point from its schema argument names.

    layout "bhsd": q [..., Hq, Sq, D], k [..., Hkv, Sk, D] (the SDPA ops, cuDNN dense);
    layout "bshd": q [B, Sq, Hq, D], k [B, Sk, Hkv, D] (_flash/_efficient_attention_*).
    ``cum`` names (cu_q, cu_k, max_q, max_k): varlen when q is 3-D [Tq, Hq, D] (flash,
    cuDNN) or cu_q is given with q [1, Tq, Hq, D] (efficient). ``getter`` and ``count`` are
    :mod:`.flops`' ``_getter`` and ``FlopCount``, passed in when the op is resolved so that this
    module imports nothing from :mod:`.flops` (which imports it). ``paged`` names a block
    table argument (varlen_attn's paged K/V): when one is given, K's shape is the cache's
    (blocks x block size), not the keys', so only the offsets and ``max_k`` bound Sk; a
    missing ``cu_seq_k`` means the keys' offsets are the queries'."""
    q_get, k_get, v_get = (getter(func, n) for n in ("query", "key", "value"))
    c_get = getter(func, causal)
    cum_get = tuple(getter(func, n) for n in cum) if cum else None
    p_get = getter(func, paged) if paged else None
    factor = 4 if backward else 2  # backward = 2 x forward (dQ, dK, dV, dP)

    def flops(args, kwargs, out):
        q, k, v = q_get(args, kwargs), k_get(args, kwargs), v_get(args, kwargs)
        d = q.shape[-1] + v.shape[-1]
        cu_q = cum_get[0](args, kwargs) if cum_get else None
        if cu_q is not None and (q.dim() == 3 or layout == "bshd") and cu_q.shape[0] > 1:
            cu_k, max_q, max_k = (g(args, kwargs) for g in cum_get[1:])
            cu_k = cu_q if cu_k is None else cu_k
            total_k = k.shape[-3]
            if p_get is not None and p_get(args, kwargs) is not None:
                cu_k, total_k = None, q.shape[-3] * int(max_k)   # NB: paged: bounded by max_k
            pairs = _varlen_pairs(cu_q, cu_k, max_q, max_k, q.shape[-3], total_k)
            n = factor * q.shape[-2] * pairs * d
        else:
            s_k = k.shape[-2] if layout == "bhsd" else k.shape[-3]
            n = factor * (q.numel() // q.shape[-1]) * s_k * d
        c = c_get(args, kwargs)
        is_causal = c in (1, 2) if causal == "custom_mask_type" else bool(c)
        return _new(count, ("attention", n, n // 2 if is_causal else n))
    return flops


_FLASH_CUM = ("cum_seq_q", "cum_seq_k", "max_q", "max_k")
_EFF_CUM = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
ATTENTION_OPS = {  # op name -> attention_flops(...) keyword arguments
    "_scaled_dot_product_flash_attention_for_cpu": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_flash_attention": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_efficient_attention": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_cudnn_attention": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_fused_attention_overrideable": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_attention_math": dict(layout="bhsd", backward=False),
    "_scaled_dot_product_attention_math_for_mps": dict(layout="bhsd", backward=False),
    "_flash_attention_forward": dict(layout="bshd", backward=False, cum=_FLASH_CUM),
    "_efficient_attention_forward": dict(layout="bshd", backward=False, cum=_EFF_CUM,
                                         causal="custom_mask_type"),
    "_cudnn_attention_forward": dict(layout="bhsd", backward=False, cum=_FLASH_CUM),
    "_flash_attention_backward": dict(layout="bshd", backward=True, cum=_FLASH_CUM),
    "_efficient_attention_backward": dict(layout="bshd", backward=True, cum=_EFF_CUM,
                                          causal="custom_mask_type"),
    "_cudnn_attention_backward": dict(layout="bhsd", backward=True, cum=_FLASH_CUM),
}
for _name in ("_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_fused_attention_overrideable"):
    ATTENTION_OPS[_name + "_backward"] = dict(layout="bhsd", backward=True)


#: ``torch.nn.attention.varlen``'s custom ops (torch 2.10+): packed sequences given by
#: cumulative offsets, q/k/v [total, heads, head dim] (the flash varlen layout), causal when
#: its ``window_size`` is (-1, 0). Their inner flash/cuDNN kernels never reach a dispatch mode.
_VARLEN_CUM = ("cu_seq_q", "cu_seq_k", "max_q", "max_k")
VARLEN = {
    "torch_attn::_varlen_attn": dict(layout="bhsd", backward=False, cum=_VARLEN_CUM,
                                     paged="block_table"),
    "torch_attn::_varlen_attn_out": dict(layout="bhsd", backward=False, cum=_VARLEN_CUM,
                                         paged="block_table"),
    "torch_attn::_varlen_attn_backward": dict(layout="bhsd", backward=True, cum=_VARLEN_CUM),
}

#: Backward kernels that recompute the scores (Q K^T) they did not keep: their hardware cost is
#: 5/4 of the model count (2.5 x forward instead of 2 x).
RECOMPUTING_BACKWARD = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward", "_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_cudnn_attention_backward",
    "_varlen_attn_backward",
})


def score_recompute_flops(op_name: str, flops: int) -> int:
    """The FLOPs a backward attention kernel spends recomputing Q K^T beyond its model count
    ``flops`` (4 score-sized matmuls, so one more is ``flops // 4``); 0 for any other op.
    ``op_name`` is the schema name without its namespace."""
    return flops // 4 if op_name in RECOMPUTING_BACKWARD else 0
