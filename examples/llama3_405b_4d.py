"""Llama-3.1-405B on a 4-D layout of the kind Meta trained it with, scaled down: TP 8 x CP 2 x
PP 9 x FSDP 4 = 576 ranks, interleaved 1F1B with 7 virtual stages, bf16 mixed precision; one
micro-batch is 1 x 8,192 tokens. (The Llama 3 paper's Table 4 ran its 8K-sequence stage at TP 8,
CP 1, PP 16, DP 128 on 16,384 GPUs, and the long-context stage at CP 16; PP 9 here divides the
126 blocks into 63 equal chunks.)

    torchledger audit examples/llama3_405b_4d.py --mesh dp=4,cp=2,tp=8,pp=9 \\
        --virtual-stages 7 --micro-batches 18 --precision bf16-mixed --gpu h100

No ``parallelize``: torchledger's standard plan cuts the 126 blocks into 9 x 7 = 63 chunks of
2 (rank r holds chunks r, r + 9, ..., r + 54: 14 blocks), and on each rank applies tensor and
sequence parallelism over tp, context parallelism over cp (K/V all-gathered per layer, the
variant the Llama 3 paper describes), FSDP2 over dp x cp, and bf16 MixedPrecisionPolicy. The
576 ranks are simulated as the ranks that differ: pipeline rank 0 (embedding), a middle one
(stands for ranks 1-7) and rank 8 (head), each on fake tensors in its own fake world.

Shape (Llama-3.1-405B config.json): vocab 128,256, d 16,384, 126 layers, 128 heads, 8 KV
heads, MLP 53,248, RoPE theta 500,000.
"""
import torch

import torchledger
from torchledger.models import build_model
from torchledger.models.config import TransformerConfig

LLAMA_31_405B = TransformerConfig(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=8, d_ff=53248, mlp="swiglu", norm="rmsnorm", bias=False,
                                  tie_embeddings=False, n_positions=0, max_seq_len=8192,
                                  rope_theta=500000.0, name="llama3.1-405b")


def audit_spec():
    model = build_model(LLAMA_31_405B)
    idx = torch.randint(0, LLAMA_31_405B.vocab_size, (1, 8192))        # one micro-batch
    return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
