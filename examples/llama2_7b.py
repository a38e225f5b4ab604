"""Llama 2 7B (6,738,415,616 params), batch 1 x 2048 tokens, fp32 AdamW.

Meant for `torchledger audit examples/llama2_7b.py` on fake tensors (the default): no real
memory is touched, so it runs on a laptop. On a real device it needs ~108 GB for the static
part alone (16 bytes/param).
"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def audit_spec():
    cfg = get_config("llama2-7b")
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 2048))
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
