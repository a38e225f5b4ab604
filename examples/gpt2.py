"""GPT-2 small (124,439,808 params), batch 8 x 1024 tokens, AdamW. Audits on fake tensors."""
import torch

import torchledger
from torchledger.models import build_model, get_config


def audit_spec():
    cfg = get_config("gpt2")
    B, T = 8, 1024
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
