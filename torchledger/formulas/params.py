"""Exact parameter counts of the reference models, from their hyperparameters alone.

The count follows ``torchledger/models/transformer.py`` tensor by tensor, so it equals
``sum(p.numel() for p in build_model(cfg, device="meta").parameters())`` (tests check every
preset and random configs). Notation: V vocab, d hidden,
L layers, h / h_kv query / KV heads, d_h = d / h, d_ff MLP width.

Conventions:
  - **total** counts every distinct tensor once: a tied LM head shares the embedding's
    weight, so it adds 0 (``lm_head`` is 0 in the breakdown).
  - **matmul params** (the N of C = 6ND) are the weights that multiply activations: every
    Linear weight, the LM head included *even when tied* (it is read twice: looked up as an
    embedding, multiplied as the head). Embedding and position lookups do not multiply;
    norm weights and biases are element-wise, so they are left out as well.
  - the **12Ld^2 approximation** is 12*L*d^2 + V*d (blocks of a standard GPT: h_kv = h,
    d_ff = 4d, GELU; plus one V x d matrix); ``blocks_12ld2`` is 12*L*d^2 alone.

    >>> count_params(get_config("gpt2")).total
    124439808

Known limitations:
  - only the two reference architectures; MoE, cross-attention, QK-norm etc. are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..models.config import CruncherConfig, TransformerConfig

__all__ = ["ParamCount", "count_params", "params_12ld2", "params_12ld2_encoder_decoder",
           "COMPONENTS"]

#: Breakdown keys of a Transformer count, in display order.
COMPONENTS = ("embeddings", "positions", "attention", "mlp", "norms", "final_norm", "lm_head")


@dataclass(frozen=True)
class ParamCount:
    """Parameter count of one config."""

    total: int
    """Distinct parameters (what ``sum(p.numel())`` gives)."""
    breakdown: Mapping[str, int]
    """Per component, summing to ``total`` (all layers together)."""
    matmul: int
    """N of 6ND: weights that take part in matmuls (LM head counted even when tied)."""
    approx_12ld2: Optional[int] = None
    """12*L*d^2 + V*d; None for non-Transformers."""
    blocks_12ld2: Optional[int] = None
    """12*L*d^2 alone (the blocks of a standard GPT)."""
    per_layer: Mapping[str, int] = field(default_factory=dict)
    """One block's attention, mlp and norms."""

    @property
    def approx_rel_error(self) -> Optional[float]:
        """(approximation - exact) / exact, e.g. -0.02 for 2% under."""
        if self.approx_12ld2 is None:
            return None
        return (self.approx_12ld2 - self.total) / self.total

    def shares(self) -> dict:
        """Each component's fraction of ``total``."""
        return {k: v / self.total for k, v in self.breakdown.items()}

    def to_dict(self) -> dict:
        return {"params": self.total, "params_12ld2": self.approx_12ld2,
                "params_12ld2_blocks": self.blocks_12ld2,
                "params_12ld2_rel_error": self.approx_rel_error,
                "matmul_params": self.matmul, "breakdown": dict(self.breakdown),
                "per_layer": dict(self.per_layer), "shares": self.shares()}


def params_12ld2(d_model: int, n_layers: int, vocab_size: int = 0) -> int:
    """12*L*d^2 + V*d: 4d^2 of attention plus 8d^2 of a 4d GELU MLP per block, plus one
    V x d matrix. ``params_12ld2(4096, 32)`` = 6,442,450,944 (~6.4B).
    """
    return 12 * n_layers * d_model * d_model + vocab_size * d_model


def params_12ld2_encoder_decoder(d_model: int, n_encoder_layers: int, n_decoder_layers: int,
                                 vocab_size: int = 0) -> int:
    """12Ld^2 for an encoder-decoder stack (T5, BART): an encoder layer is 12d^2 (self-attention
    4d^2 + a 4d MLP 8d^2), a decoder layer 16d^2 (self-attention 4d^2 + cross-attention
    4d^2 + MLP 8d^2), plus one V x d matrix (the shared embedding)::

        12*L_enc*d^2 + 16*L_dec*d^2 + V*d

    ``params_12ld2_encoder_decoder(512, 6, 6, 32128)`` (t5-small) = 18,874,368 + 25,165,824
    + 16,449,536 = 60,489,728, the matmul weights of t5-small exactly (its 60,506,624
    parameters add 32 RMSNorm weights of 512 and two 32 x 8 relative-position tables).
    """
    return (12 * n_encoder_layers + 16 * n_decoder_layers) * d_model * d_model + vocab_size * d_model


def _norm_params(cfg: TransformerConfig) -> int:
    # nn.RMSNorm: weight (d). nn.LayerNorm: weight (d), plus bias (d) only when cfg.bias.
    if cfg.norm == "rmsnorm":
        return cfg.d_model
    return cfg.d_model * (2 if cfg.bias else 1)


def _attention(cfg: TransformerConfig) -> tuple:
    """(weights, biases) of one block's q, k, v, o projections."""
    d, q_dim, kv_dim = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    weights = d * q_dim + 2 * d * kv_dim + q_dim * d
    biases = (q_dim + 2 * kv_dim + d) if cfg.bias else 0
    return weights, biases


def _mlp(cfg: TransformerConfig) -> tuple:
    """(weights, biases) of one block's MLP: up + down (GELU) or gate + up + down (SwiGLU, GeGLU)."""
    n_in = 2 if cfg.gated else 1          # projections d -> d_ff
    weights = (n_in + 1) * cfg.d_model * cfg.d_ff
    biases = (n_in * cfg.d_ff + cfg.d_model) if cfg.bias else 0
    return weights, biases


def _count_transformer(cfg: TransformerConfig) -> ParamCount:
    V, d, L = cfg.vocab_size, cfg.d_model, cfg.n_layers
    attn_w, attn_b = _attention(cfg)
    mlp_w, mlp_b = _mlp(cfg)
    norm = _norm_params(cfg)
    per_layer = {"attention": attn_w + attn_b, "mlp": mlp_w + mlp_b, "norms": 2 * norm}
    breakdown = {
        "embeddings": V * d,
        "positions": cfg.n_positions * d,
        "attention": L * per_layer["attention"],
        "mlp": L * per_layer["mlp"],
        "norms": L * per_layer["norms"],
        "final_norm": norm,
        "lm_head": 0 if cfg.tie_embeddings else V * d,
    }
    return ParamCount(total=sum(breakdown.values()), breakdown=breakdown,
                      matmul=L * (attn_w + mlp_w) + V * d,
                      approx_12ld2=params_12ld2(d, L, V), blocks_12ld2=params_12ld2(d, L),
                      per_layer=per_layer)


def _count_cruncher(cfg: CruncherConfig) -> ParamCount:
    # num_layers x (dim x dim) weights, then a (dim x 1) head; no biases (docs/counting.md).
    breakdown = {"layers": cfg.num_layers * cfg.dim * cfg.dim, "final": cfg.dim}
    total = sum(breakdown.values())
    return ParamCount(total=total, breakdown=breakdown, matmul=total,
                      per_layer={"layer": cfg.dim * cfg.dim})


def count_params(cfg) -> ParamCount:
    """Exact :class:`ParamCount` of a :class:`TransformerConfig` or :class:`CruncherConfig`.

    Llama 2 7B: 32*(67,108,864 + 135,266,304 + 8,192) + 2*131,072,000 + 4,096
    = 6,738,415,616.
    """
    if isinstance(cfg, TransformerConfig):
        return _count_transformer(cfg)
    if isinstance(cfg, CruncherConfig):
        return _count_cruncher(cfg)
    raise TypeError(f"expected a TransformerConfig or CruncherConfig, got {type(cfg).__name__}")
