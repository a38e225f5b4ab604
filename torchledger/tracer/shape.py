"""Recognise a model's architecture so predictions can be made from the record alone.

Returns a plain dict in ``TransformerConfig`` terms (vocab_size, d_model, n_layers,
n_heads, n_kv_heads, d_ff, mlp, norm, bias, tie_embeddings, n_positions) for torchledger's
reference models and for Hugging Face models (from their ``config``), a Cruncher dict for
the course model, or None when the model is not recognised.
"""
from __future__ import annotations

import dataclasses

__all__ = ["model_config"]


def model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    from ..models.config import CruncherConfig, TransformerConfig
    if isinstance(cfg, (TransformerConfig, CruncherConfig)):
        d = dataclasses.asdict(cfg)
        d["kind"] = cfg.kind
        d["source"] = "torchledger"
        return d
    if hasattr(cfg, "to_dict"):
        return _from_hf(cfg)
    return None


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _from_hf(cfg):
    d = _first(cfg, "hidden_size", "n_embd", "d_model")
    L = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    h = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    V = _first(cfg, "vocab_size")
    if not all(isinstance(x, int) for x in (d, L, h, V)):
        return None
    act = str(_first(cfg, "hidden_act", "activation_function", default="")).lower()
    model_type = str(getattr(cfg, "model_type", ""))
    swiglu = act in ("silu", "swish") and model_type not in ("gpt2",)
    ff = _first(cfg, "intermediate_size", "n_inner")
    norm = "rmsnorm" if (hasattr(cfg, "rms_norm_eps") and not hasattr(cfg, "layer_norm_epsilon")) else "layernorm"
    return {
        "kind": "transformer", "source": f"huggingface:{model_type or type(cfg).__name__}",
        "vocab_size": V, "d_model": d, "n_layers": L, "n_heads": h,
        "n_kv_heads": _first(cfg, "num_key_value_heads", default=h),
        "d_ff": ff if isinstance(ff, int) else 4 * d,
        "mlp": "swiglu" if swiglu else "gelu", "norm": norm,
        "bias": bool(_first(cfg, "attention_bias", "bias", default=model_type == "gpt2")),
        "tie_embeddings": bool(_first(cfg, "tie_word_embeddings", default=True)),
        "n_positions": int(_first(cfg, "n_positions", default=0)) if model_type == "gpt2" else 0,
    }
