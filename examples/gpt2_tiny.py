"""A tiny GPT-2 (2 layers, d=64): the quickest audit. `torchledger audit examples/gpt2_tiny.py`"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def audit_spec():
    cfg = get_config("gpt2-tiny")
    B, T = 4, 64
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    return torchledger.AuditSpec(model, {"idx": idx, "targets": targets})
