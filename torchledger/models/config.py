"""Configs and named presets of the reference models (pure Python, no torch).

Two config classes cover every reference model:

* :class:`TransformerConfig`: a decoder-only Transformer. GPT-2 (learned positions,
  LayerNorm with bias, GELU MLP of 4d, biases, tied LM head) and Llama/Mistral (RoPE,
  RMSNorm, SwiGLU, grouped-query attention, no biases, untied head) are two settings of it.
* :class:`CruncherConfig`: the course's deep linear model (docs/counting.md).

Hyperparameters of the presets are those of the public model configs (HF ``config.json``
of each model). Both classes validate in ``__post_init__`` and name the offending field in
their ``ValueError``, so the CLI can show one clear line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["TransformerConfig", "CruncherConfig", "PRESETS", "get_config", "preset_names", "GATED_MLPS"]

MLP_KINDS = ("gelu", "swiglu", "geglu")
#: Gated MLPs (GLU variants, Shazeer 2020): act(x W_gate) * (x W_up), then W_down, three
#: d x d_ff matrices. SwiGLU gates with SiLU (Llama, Mistral, Qwen), GeGLU with GELU (Gemma,
#: T5 v1.1's "gated-gelu").
GATED_MLPS = ("swiglu", "geglu")
NORM_KINDS = ("layernorm", "rmsnorm")


def _positive(name: str, value, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def llama_ffn(d_model: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    """Llama's MLP width rule: 2/3 of 4d, times ``multiplier``, rounded up to ``multiple_of``.

    d=4096 -> 11008 (Llama 2 7B); d=5120 -> 13824 (13B).
    """
    hidden = int(2 * 4 * d_model / 3)
    hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only Transformer. Shapes: B batch, T sequence, d = ``d_model``."""

    vocab_size: int
    """V: rows of the token embedding (and of the LM head)."""
    d_model: int
    """d: width of the residual stream."""
    n_layers: int
    """L: number of blocks."""
    n_heads: int
    """h: query heads; head dim d_h = d / h."""
    n_kv_heads: Optional[int] = None
    """h_kv: key/value heads (grouped-query attention); None means h (multi-head)."""
    d_ff: Optional[int] = None
    """MLP width; None means 4d for GELU and Llama's rounding of 8d/3 for a gated MLP."""
    mlp: str = "gelu"
    """'gelu' (up, down: 2*d*d_ff), or a gated MLP (gate, up, down: 3*d*d_ff): 'swiglu'
    (SiLU gate) or 'geglu' (GELU gate)."""
    norm: str = "layernorm"
    """'layernorm' (weight, plus bias when ``bias``) or 'rmsnorm' (weight only)."""
    bias: bool = True
    """Biases on q/k/v/o and MLP projections and on LayerNorm. The LM head never has one."""
    tie_embeddings: bool = True
    """LM head shares the token embedding's weight (counted once)."""
    n_positions: int = 0
    """Rows of a learned position table (GPT-2: 1024); 0 means rotary embeddings (RoPE)."""
    max_seq_len: int = 2048
    """Longest sequence the model is meant for (the context of the public config)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    name: str = ""

    def __post_init__(self):
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive(key, getattr(self, key))
        _positive("n_positions", self.n_positions, allow_zero=True)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _positive("n_kv_heads", self.n_kv_heads)
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp must be one of {', '.join(MLP_KINDS)}, got {self.mlp!r}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {', '.join(NORM_KINDS)}, got {self.norm!r}")
        if self.d_ff is None:
            d_ff = 4 * self.d_model if self.mlp == "gelu" else llama_ffn(self.d_model)
            object.__setattr__(self, "d_ff", d_ff)
        _positive("d_ff", self.d_ff)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads}); head dim would be {self.d_model / self.n_heads:g}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads}) for grouped-query attention")
        if self.n_positions and self.n_positions < self.max_seq_len:
            object.__setattr__(self, "max_seq_len", self.n_positions)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def gated(self) -> bool:
        """A gated MLP (three d x d_ff matrices): SwiGLU or GeGLU."""
        return self.mlp in GATED_MLPS

    @property
    def kind(self) -> str:
        return "transformer"

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CruncherConfig:
    """The course's deep linear model: ``num_layers`` x Linear(dim, dim), then Linear(dim, 1)."""

    dim: int
    num_layers: int
    name: str = ""

    def __post_init__(self):
        _positive("dim", self.dim)
        _positive("num_layers", self.num_layers)

    @property
    def kind(self) -> str:
        return "cruncher"

    def replace(self, **changes) -> "CruncherConfig":
        return dataclasses.replace(self, **changes)


Config = Union[TransformerConfig, CruncherConfig]


def _gpt2(name, d, L, h, **kw):
    return TransformerConfig(vocab_size=50257, d_model=d, n_layers=L, n_heads=h, mlp="gelu",
                             norm="layernorm", bias=True, tie_embeddings=True,
                             n_positions=kw.pop("n_positions", 1024), name=name, **kw)


def _llama(name, V, d, L, h, kv, ff, ctx, theta=10000.0, eps=1e-5, tied=False):
    return TransformerConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=h, n_kv_heads=kv,
                             d_ff=ff, mlp="swiglu", norm="rmsnorm", bias=False,
                             tie_embeddings=tied, n_positions=0, max_seq_len=ctx,
                             rope_theta=theta, norm_eps=eps, name=name)


def _gpt3(name, d, L, h):
    """Brown et al. 2020, Table 2.1 (the rows whose d_head is d / h), with Megatron-LM's
    vocabulary padded to 51,200 (GPT-2's 50,257 rounded up to a multiple of 128 x 8, as
    Megatron's GPT runs pad it) and 2,048 learned positions."""
    return TransformerConfig(vocab_size=51200, d_model=d, n_layers=L, n_heads=h, mlp="gelu",
                             norm="layernorm", bias=True, tie_embeddings=True, n_positions=2048,
                             max_seq_len=2048, name=name)


#: Named presets. The big ones are meant for the meta device or fake tensors.
PRESETS: dict[str, Config] = {
    c.name: c for c in [
        _gpt2("gpt2", 768, 12, 12),
        _gpt2("gpt2-medium", 1024, 24, 16),
        _gpt2("gpt2-large", 1280, 36, 20),
        _gpt2("gpt2-xl", 1600, 48, 25),
        _llama("llama2-7b", 32000, 4096, 32, 32, 32, 11008, 4096),
        _llama("llama2-13b", 32000, 5120, 40, 40, 40, 13824, 4096),
        _llama("llama2-70b", 32000, 8192, 80, 64, 8, 28672, 4096),
        _llama("llama3-8b", 128256, 4096, 32, 32, 8, 14336, 8192, theta=500000.0),
        _llama("llama3-70b", 128256, 8192, 80, 64, 8, 28672, 8192, theta=500000.0),
        # Llama 3 paper (arXiv 2407.21783) Table 3: 126 layers, d 16,384, FFN 53,248, 128 heads, 8 KV
        _llama("llama3-405b", 128256, 16384, 126, 128, 8, 53248, 8192, theta=500000.0),
        # Llama 3.1: the same shapes, 128k context (its RoPE scaling changes no count or shape)
        _llama("llama3.1-8b", 128256, 4096, 32, 32, 8, 14336, 131072, theta=500000.0),
        _llama("llama3.1-70b", 128256, 8192, 80, 64, 8, 28672, 131072, theta=500000.0),
        _llama("llama3.1-405b", 128256, 16384, 126, 128, 8, 53248, 131072, theta=500000.0),
        # Llama 3.2 1B / 3B (their config.json): tied embeddings
        _llama("llama3.2-1b", 128256, 2048, 16, 32, 8, 8192, 131072, theta=500000.0, tied=True),
        _llama("llama3.2-3b", 128256, 3072, 28, 24, 8, 8192, 131072, theta=500000.0, tied=True),
        _gpt3("gpt3-125m", 768, 12, 12),
        _gpt3("gpt3-350m", 1024, 24, 16),
        _gpt3("gpt3-2.7b", 2560, 32, 32),
        _gpt3("gpt3-6.7b", 4096, 32, 32),
        _gpt3("gpt3-13b", 5120, 40, 40),
        _gpt3("gpt3-175b", 12288, 96, 96),
        _llama("mistral-7b", 32000, 4096, 32, 32, 8, 14336, 32768, theta=10000.0),
        # Small models for tests, demos and benchmarks (CPU-friendly).
        _gpt2("gpt2-tiny", 64, 2, 4, n_positions=128).replace(vocab_size=512),
        _gpt2("gpt-mini", 256, 4, 8).replace(vocab_size=8192),
        _llama("llama-tiny", 512, 64, 2, 4, 2, 176, 256),
        CruncherConfig(dim=128, num_layers=4, name="cruncher"),
    ]
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_config(name: str) -> Config:
    """The preset called ``name``; a ``KeyError`` that lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
