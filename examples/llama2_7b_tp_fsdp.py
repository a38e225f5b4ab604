"""Llama 2 7B on a 2-D mesh: tensor parallelism inside 8 ranks (one node), FSDP2 across 8
(``--mesh 8x8``: dims ``dp`` x ``tp``, 64 ranks), batch 1 x 2048 tokens per data-parallel
rank, fp32 AdamW.

    torchledger audit examples/llama2_7b_tp_fsdp.py --mesh 8x8 --gpu H100

Per block, as Megatron-LM and torchtitan split it: q/k/v and the MLP's gate/up projections
column-wise, o and down projections row-wise (one all-reduce of the block's output per
attention and per MLP in forward, and in backward); then each block is one FSDP2 unit over
the ``dp`` dim. The embedding, final norm and LM head are sharded by FSDP2 only.
"""
import torch

import torchledger
from torchledger.models import build_model, get_config


def parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    tp, dp = mesh["tp"], mesh["dp"]
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp, plan)
        # each rank now computes its own heads: the views in Attention.forward see them
        block.attn.n_heads //= tp.size()
        block.attn.n_kv_heads //= tp.size()
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


def audit_spec():
    cfg = get_config("llama2-7b")
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 2048))         # one data-parallel rank's batch
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx}, parallelize=parallelize)
