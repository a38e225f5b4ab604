"""DeepSeek-V2/V3's multi-head latent attention (transformers 5.x ``DeepseekV3Attention``) under
tensor parallelism, as Megatron-Core and torchtitan split it.

The up-projections are split by heads: the query's (``q_proj``, or ``q_b_proj`` after the
low-rank ``q_a_proj`` -> ``q_a_layernorm``) and ``kv_b_proj`` ``ColwiseParallel``, ``o_proj``
``RowwiseParallel``. The down-projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` and their
norms are whole on every tp rank (their outputs, the latents, are shared by all heads), computed
again on each: Megatron's "duplicated" linears.

Their gradients: ``ColwiseParallel`` all-reduces the gradient of its input over tp, so the
latents' gradients are whole on every rank. The rotary key ``k_rot`` (the last
``qk_rope_head_dim`` columns of ``kv_a_proj_with_mqa``'s output) reaches the attention
directly, shared by the rank's heads only: its gradient is a partial sum over tp, all-reduced
here (B x T x qk_rope_head_dim elements a layer) so that every replicated weight's gradient is
the same on every tp rank, as it is in training.

**The attention kernel.** Its q/k head dim (nope + rope: 192 in DeepSeek-V3) differs from its v
head dim (128). On a GPU, SDPA runs such heads in its memory-efficient kernel (flash takes equal
head dims only); on CPU, where fake tensors trace, SDPA has only its flash kernel (equal dims)
and the math path, which materialises the B x h x T x T scores and probabilities, keeps them
for backward and prices them as memory-bound ops. The plan's attention function
(``torchledger_mla``) calls the memory-efficient kernel on fake tensors instead, causal by its
flag (the explicit mask of a causal LM dropped, as transformers passes none on a GPU without
padding): the kernel, FLOPs (2 x b x h x sq x sk x (d + dv)) and memory a GPU run has.
"""
from __future__ import annotations

import functools

__all__ = ["MLA_ATTENTION", "is_latent_attention", "latent_tp_plan", "sum_rotary_key_grads", "fused_attention",
           "use_fused_latent_attention"]

#: The name the latent attention's function is registered under in transformers' AttentionInterface.
MLA_ATTENTION = "torchledger_mla"


def is_latent_attention(attn) -> bool:
    """``attn`` is DeepSeek's latent attention: its query (``q_proj`` or ``q_b_proj``),
    ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj``."""
    query = getattr(attn, "q_proj", None) is not None or getattr(attn, "q_b_proj", None) is not None
    return query and all(getattr(attn, p, None) is not None for p in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


def latent_tp_plan(attn, prefix: str) -> dict:
    """The attention's entries of a block's tp plan (``prefix``: its FQN in the block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    query = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_b_proj"
    return {f"{prefix}.{query}": ColwiseParallel(), f"{prefix}.kv_b_proj": ColwiseParallel(),
            f"{prefix}.o_proj": RowwiseParallel()}


def sum_rotary_key_grads(attn, tp_mesh) -> None:
    """All-reduce over tp the gradient of the rotary key columns of ``kv_a_proj_with_mqa``'s
    output (a forward hook: identity forward)."""
    rope = int(attn.qk_rope_head_dim)
    fn = _rope_grad_sum()

    def hook(module, args, out):
        return fn.apply(out, tp_mesh, rope)
    attn.kv_a_proj_with_mqa.register_forward_hook(hook)


@functools.lru_cache(maxsize=None)
def _rope_grad_sum():
    """The autograd function, made on first use (this module imports without torch)."""
    import torch
    from torch.distributed import _functional_collectives as funcol

    class RopeGradSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mesh, rope):
            ctx.mesh, ctx.rope = mesh, rope
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            latent, rot = grad.split([grad.shape[-1] - ctx.rope, ctx.rope], dim=-1)
            rot = funcol.wait_tensor(funcol.all_reduce(rot.contiguous(), "sum", ctx.mesh))
            return torch.cat([latent, rot], dim=-1), None, None
    return RopeGradSum


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return bool(is_fake(t))


def fused_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0, **kw):
    """``F.scaled_dot_product_attention``; where the value head dim differs from the query's on
    fake tensors, the memory-efficient kernel SDPA runs for it on a GPU (CPU's SDPA would take
    its math path)."""
    import torch
    import torch.nn.functional as F
    if query.shape[-1] == value.shape[-1] or attn_mask is not None or kw.get("enable_gqa") or not _is_fake(query):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, dropout_p=dropout_p, **kw)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p,
                                                                 is_causal, scale=scale)
    return out[0]


def _latent_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: the fused kernel (:func:`fused_attention`), causal by
    its flag, where the head dims differ on fake tensors; else transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if query.shape[-1] == value.shape[-1] or not _is_fake(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    causal = query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = fused_attention(query, key, value, is_causal=causal, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def use_fused_latent_attention(model) -> bool:
    """Register :data:`MLA_ATTENTION` and select it by the model's config where it runs SDPA
    (transformers' default); False where the config chose another attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    config = getattr(model, "config", None)
    if config is None or (config._attn_implementation or "sdpa") not in ("sdpa", MLA_ATTENTION):
        return False
    AttentionInterface.register(MLA_ATTENTION, _latent_attention)
    if MLA_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(MLA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = MLA_ATTENTION
    return True
