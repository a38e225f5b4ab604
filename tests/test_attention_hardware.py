"""Attention in hardware FLOPs: the flash, memory-efficient and cuDNN backward kernels keep no
score matrix and recompute Q K^T, five score-sized matmuls where the model count has four
(PyTorch's own FlopCounterMode counts their backward as 2.5 x forward). Model FLOPs stay at
2 x forward (the 6ND convention); ``hardware_flops`` (HFU) counts what the kernel executes.
The SDPA math path (meta device) runs plain bmm: its backward is 2 x in both.

Shared sizes: B=2, H=4, T=16, head dim d=64.
  forward   4*B*H*T*T*d = 4*2*4*16*16*64          =   524,288
  backward  model 2x    = 2 * 524,288             = 1,048,576
            hardware 2.5x = 2.5 * 524,288         = 1,310,720 (score recompute 262,144)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchledger
from torchledger.tracer.flops import op_flops

B, H, T, HD = 2, 4, 16, 64
FWD = 4 * B * H * T * T * HD          # 524,288
MODEL_BWD = 2 * FWD                   # 1,048,576
HARDWARE_BWD = 5 * FWD // 2           # 1,310,720


class SDPA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v).sum()


def _trace_sdpa(device, fake=False):
    ctx = FakeTensorMode() if fake else torch.device(device)
    with ctx:
        q, k, v = (torch.randn(B, H, T, HD, requires_grad=True) for _ in range(3))
        m = SDPA()
        with torchledger.trace(m, tokens=B * T) as t:
            m(q, k, v).backward()
    return t.record


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake-cpu"])
def test_flash_backward_is_2_5x_forward_in_hardware_flops(fake):
    rec = _trace_sdpa("cpu", fake=fake)
    t = rec.totals
    assert rec.meta["attention_kernels"] == ["CPU flash attention"]
    assert t["flops"]["forward"] == FWD                         # 524,288
    assert t["flops"]["backward"] == MODEL_BWD                  # model: 2x forward
    assert t["flops"]["total"] == FWD + MODEL_BWD               # 1,572,864: 6ND's convention
    assert t["attention_flops"]["score_recompute"] == FWD // 2  # 262,144: one Q K^T
    assert t["hardware_flops"] == FWD + HARDWARE_BWD            # 524,288 + 1,310,720 = 1,835,008


def test_math_path_backward_is_2x_in_both():
    rec = _trace_sdpa("meta")
    t = rec.totals
    assert rec.meta["attention_kernels"] == ["SDPA math path (bmm + softmax)"]
    assert t["flops"]["total"] == FWD + MODEL_BWD               # 1,572,864
    assert t["attention_flops"]["score_recompute"] == 0
    assert t["hardware_flops"] == FWD + MODEL_BWD               # the bmm the math path runs


def test_hfu_reads_the_kernel_count():
    from torchledger.analyzers.mfu import mfu as mfu_hfu
    rec = _trace_sdpa("cpu")
    rec.totals["step_seconds"] = 1.0
    mfu, hfu = mfu_hfu(rec, 1e7)
    assert mfu == pytest.approx(1_572_864 / 1e7)
    assert hfu == pytest.approx(1_835_008 / 1e7)               # 2.5x backward in HFU only


varlen = pytest.importorskip("torch.nn.attention.varlen")


class Varlen(nn.Module):
    def __init__(self, window=(-1, -1)):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, cu, max_len):
        return varlen.varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=self.window).sum()


@pytest.mark.parametrize("fake", [False, True], ids=["meta", "fake-cpu"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attn_is_attention_not_matmul(fake, causal):
    """Two packed sequences of T=16 tokens: the same pairs as the dense B=2 batch above, so
    the same figures; window (-1, 0) is varlen_attn's causal mask: half of the dense count."""
    ctx = FakeTensorMode() if fake else torch.device("meta")
    with ctx:
        q, k, v = (torch.randn(B * T, H, HD, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, T, 2 * T], dtype=torch.int32)
        m = Varlen((-1, 0) if causal else (-1, -1))
        with torchledger.trace(m, tokens=B * T) as t:
            m(q, k, v, cu, T).backward()
    tot = t.record.totals
    assert t.record.meta["attention_kernels"] == ["varlen attention (flash or cuDNN)"]
    assert tot["attention_flops"]["dense"] == FWD + MODEL_BWD            # 1,572,864
    assert tot["flops"]["total"] == FWD + MODEL_BWD
    # causal: (524,288 + 1,048,576) / 2 = 786,432
    assert tot["attention_flops"]["causal"] == ((FWD + MODEL_BWD) // 2 if causal else FWD + MODEL_BWD)
    assert tot["hardware_flops"] == FWD + HARDWARE_BWD                   # 1,835,008
    assert not [o for o in t.record.ops if o["kind"] == "matmul"]


def test_varlen_formula_reads_real_offsets():
    """Unequal lengths 10 and 22 (max 22): sum Sq_i*Sk_i = 10*10 + 22*22 = 584 pairs; forward
    2 * H * pairs * (Dqk + Dv) = 2*4*584*128 = 598,016; backward 2x = 1,196,032."""
    q = torch.empty(32, H, HD, device="meta")
    cu = torch.tensor([0, 10, 32], dtype=torch.int32)
    fwd = op_flops(torch.ops.torch_attn._varlen_attn.default, (q, q, q, cu, cu, 22, 22, True), {},
                   None)
    assert (fwd.kind, fwd.flops, fwd.flops_causal) == ("attention", 598_016, 299_008)
    bwd = op_flops(torch.ops.torch_attn._varlen_attn_backward.default,
                   (q, q, q, q, q, None, cu, cu, 22, 22, False, None), {}, None)
    assert (bwd.kind, bwd.flops, bwd.flops_causal) == ("attention", 1_196_032, 1_196_032)
