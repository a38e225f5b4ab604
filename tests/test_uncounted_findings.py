"""TL-FLOP-001 claims "the FLOP totals are a lower bound" only for uncounted ops that may do
matmul-class work (issue 20, item 6): the totals count matmul-class work alone, so pooling,
upsampling, activations and their backward cannot change them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import torchledger
from torchledger.analyzers.checks import check_uncounted_ops, may_be_matmul


class _Vision(torch.nn.Module):
    """The uncounted ops of MobileNetV3 / DeepLabV3 / Mamba in one tiny net."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = F.hardswish(self.conv(x))
        y = F.max_pool2d(y, 2)
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        return F.softplus(y).mean()


def _flop_001(model, x, backward=True):
    with torchledger.trace(model) as t:
        loss = model(x)
        if backward:
            loss.backward()
    return t.record, [f for f in t.findings() if f.rule == "TL-FLOP-001"]


def test_non_matmul_uncounted_ops_do_not_make_totals_a_lower_bound():
    torch.manual_seed(0)
    rec, (f,) = _flop_001(_Vision(), torch.randn(1, 3, 8, 8))
    ops = {u["op"] for u in rec.uncounted_ops}
    assert {"aten.hardswish.default", "aten.max_pool2d_with_indices.default",
            "aten.softplus_backward.default"} <= ops, ops
    assert any(op.startswith("aten.upsample_bilinear2d") for op in ops), ops
    assert "lower bound" not in f.message and "lower bound" not in (f.hint or "")
    assert "none is matmul-class" in f.message
    assert f.measured == sum(u["count"] for u in rec.uncounted_ops)
    # the conv is counted: forward 2 x (4*8*8 outputs) x (3*3*3 taps) = 13,824
    assert rec.totals["flops"]["forward"] == 13_824


torch.library.define("tltest::fused_proj", "(Tensor x, Tensor w) -> Tensor")


@torch.library.impl("tltest::fused_proj", "CompositeExplicitAutograd")
def _fused_proj(x, w):
    return x @ w


@torch.library.register_fake("tltest::fused_proj")
def _fused_proj_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class _Custom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.hardswish(torch.ops.tltest.fused_proj(x, self.w)).sum()


def test_a_custom_op_may_multiply_matrices_so_totals_are_a_lower_bound():
    rec, (f,) = _flop_001(_Custom(), torch.randn(2, 4), backward=False)   # no autograd formula
    assert "tltest.fused_proj.default x1" in f.message
    assert "the FLOP totals are a lower bound" in f.message
    assert "aten.hardswish.default" in f.message.split("lower bound")[1]     # listed apart


def test_which_names_may_multiply_matrices():
    assert not any(map(may_be_matmul, ["aten.hardswish_backward.default", "aten.upsample_bilinear2d.vec",
                                       "aten.max_pool2d_with_indices_backward.default", "aten.sort.default",
                                       "aten.softplus_backward.default", "torchvision.roi_align.default"]))
    assert all(map(may_be_matmul, ["aten._linalg_svd.default", "aten._fft_r2c.default", "aten.slow_conv3d_forward.default",
                                   "aten._weight_int4pack_mm.default", "aten._cdist_forward.default",
                                   "flash_attn._flash_attn_forward.default", "mylib.op", "garbage"]))


def test_empty_records():
    assert check_uncounted_ops([]) == []
