"""Reference models: a Config dataclass plus named presets, buildable on any device.

    >>> from torchledger.models import build_model, get_config
    >>> model = build_model("gpt2", device="meta")       # 124,439,808 parameters, no memory
    >>> cfg = get_config("llama2-7b").replace(n_layers=2)

``build_model`` builds under ``torch.device(device)``; for fake tensors build it inside a
``FakeTensorMode`` (what ``torchledger audit`` does).
"""
from __future__ import annotations

from contextlib import nullcontext

from .config import PRESETS, CruncherConfig, TransformerConfig, get_config, preset_names

__all__ = ["build_model", "example_inputs", "get_config", "preset_names", "PRESETS",
           "TransformerConfig", "CruncherConfig"]


def build_model(config, device=None, dtype=None):
    """Build the model of a preset name or a config, on ``device`` (meta, cpu, cuda, ...)."""
    import torch

    cfg = get_config(config) if isinstance(config, str) else config
    ctx = torch.device(device) if device is not None else nullcontext()
    with ctx:
        if isinstance(cfg, CruncherConfig):
            from .cruncher import Cruncher
            model = Cruncher(cfg)
        elif isinstance(cfg, TransformerConfig):
            from .transformer import Transformer
            model = Transformer(cfg)
        else:
            raise TypeError(f"expected a preset name, TransformerConfig or CruncherConfig, "
                            f"got {type(config).__name__}")
    if dtype is not None:
        model = model.to(dtype)
    return model


def example_inputs(config, batch: int = 2, seq_len: int = 16, device=None, targets: bool = True):
    """Random inputs for a model: token ids (and targets) for Transformers, (B, dim) for Cruncher.

    Returns a dict of keyword arguments for ``model(**inputs)``.
    """
    import torch

    cfg = get_config(config) if isinstance(config, str) else config
    if isinstance(cfg, CruncherConfig):
        return {"x": torch.randn(batch, cfg.dim, device=device)}
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    out = {"idx": idx}
    if targets:
        out["targets"] = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    return out
