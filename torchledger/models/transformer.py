"""A decoder-only Transformer in nanoGPT style: GPT-2 and Llama are two configs of it.

Module names (what reports show): ``tok_emb``, ``pos_emb`` (learned positions only),
``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{q,k,v,o}_proj``, ``blocks.{i}.mlp_norm``,
``blocks.{i}.mlp.{gate,up,down}_proj`` (``gate_proj`` for SwiGLU only), ``norm``, ``lm_head``.

Attention goes through ``F.scaled_dot_product_attention`` (causal); grouped-query attention
uses its ``enable_gqa`` flag where torch has it (2.5+), else K/V heads are repeated.
Everything is views except where a kernel needs dense input, so the reference models are
the clean baseline that copy findings are measured against.
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TransformerConfig

__all__ = ["Transformer"]

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(T: int, head_dim: int, theta: float, device, dtype):
    """cos and sin tables of shape (T, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)                     # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: (B, h, T, d_h). Rotate pairs (i, i + d_h/2) by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    #: Attention function in place of ``F.scaled_dot_product_attention`` (same signature);
    #: context parallelism sets one that gathers K/V over its group (``torchledger.parallel.plan``).
    sdpa = None

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv * dh, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv * dh, bias=cfg.bias)
        self.o_proj = nn.Linear(h * dh, d, bias=cfg.bias)

    def forward(self, x, rope=None):
        B, T, d = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)     # (B, h, T, d_h)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, h_kv, T, d_h)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        attend = self.sdpa or F.scaled_dot_product_attention
        if self.n_kv_heads == self.n_heads:
            y = attend(q, k, v, is_causal=True)
        elif _SDPA_HAS_GQA:
            y = attend(q, k, v, is_causal=True, enable_gqa=True)
        else:  # NB: torch < 2.5 has no enable_gqa: repeating K/V is a real copy
            rep = self.n_heads // self.n_kv_heads
            y = attend(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)                                        # (B, T, d)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gated, self.silu = cfg.gated, cfg.mlp == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        if self.gated:     # SwiGLU (SiLU gate) or GeGLU (GELU gate, Gemma's tanh approximation)
            g = self.gate_proj(x)
            g = F.silu(g) if self.silu else F.gelu(g, approximate="tanh")
            return self.down_proj(g * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        if getattr(cfg, "n_experts", 0):
            from .moe import MoE
            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, rope=None):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """``model(idx)`` -> logits (B, T, V); ``model(idx, targets)`` -> mean cross-entropy loss."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.n_positions, cfg.d_model) if cfg.n_positions else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        cfg = self.config
        if cfg.n_positions and T > cfg.n_positions:
            raise ValueError(f"sequence length {T} exceeds the {cfg.n_positions} learned positions")
        x = self.tok_emb(idx)                                                          # (B, T, d)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        else:
            rope = rope_tables(T, cfg.head_dim, cfg.rope_theta, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.lm_head(self.norm(x))                                            # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d={cfg.d_model}, L={cfg.n_layers}, h={cfg.n_heads}, h_kv={cfg.n_kv_heads}, "
                f"V={cfg.vocab_size}, mlp={cfg.mlp}, norm={cfg.norm}")


