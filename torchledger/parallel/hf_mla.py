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
"""
from __future__ import annotations

import functools

__all__ = ["is_latent_attention", "latent_tp_plan", "sum_rotary_key_grads"]


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
