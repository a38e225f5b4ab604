"""Llama 3 8B (8,030,261,248 params): d 4096, 32 blocks, 32 heads, 8 KV heads, MLP 14336,
vocabulary 128256, one sequence of 8192 tokens a micro-batch, fp32 AdamW.

Meant for `torchledger plan examples/llama3_8b.py --gpu h100 --gpus 64 --global-batch 64`
and `torchledger audit` on fake tensors (the default): no real memory is touched.
"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def audit_spec():
    cfg = get_config("llama3-8b")
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 8192))
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
