"""Llama 2 7B with FSDP2 (``fully_shard``) over each transformer block and the root: one
rank's step at a simulated world size, batch 1 x 2048 tokens per rank, fp32 AdamW.

    torchledger audit examples/llama2_7b_fsdp.py --world-size 64 --gpu H100

Runs on fake tensors under a fake process group (no GPU, no real memory): the report is rank
0's, with parameters, gradients and AdamW state sharded 64 ways (ZeRO-3), the all-gathers and
reduce-scatters FSDP2 issues, and TL-MEM-002 saying whether the per-rank peak fits an H100.
Without ``--world-size`` the file audits as the unsharded single-process step.
"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def parallelize(model, mesh):
    """FSDP2 as torchtitan applies it: each block is one unit (its parameters are gathered
    just before its forward and freed after), the root holds the embedding, final norm and head."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def audit_spec():
    cfg = get_config("llama2-7b")
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 2048))         # one rank's batch
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx}, parallelize=parallelize)
