"""Hand-checked FLOP formulas of torchledger.tracer.flops (FLOP = 2 x multiply-add).

Every expected number carries its arithmetic in a comment, as in PyTorch's test_flop_counter.py.
CUDA-only attention entry points are costed by calling ``op_flops`` directly with meta tensors:
they are never executed, and no fake CUDA tensor is ever made (that aborts a CPU-only wheel).
"""
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from _optional_hypothesis import given, settings, st  # skipped without hypothesis
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchledger.tracer.flops import FLOP_KINDS, FlopCount, op_flops

aten = torch.ops.aten


class FlopTally(TorchDispatchMode):
    """Sums op_flops per kind for everything run under it; lists ops without a formula."""

    def __init__(self):
        super().__init__()
        self.flops, self.causal, self.uncounted, self.ops = Counter(), Counter(), Counter(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_flops(func, args, kwargs, out)
        if cost is None:
            self.uncounted[str(func)] += 1
        else:
            assert cost.kind in FLOP_KINDS
            self.flops[cost.kind] += cost.flops
            self.causal[cost.kind] += cost.flops_causal
            self.ops.append((func, cost))
        return out


def tally(fn, *args, **kwargs):
    with FlopTally() as t:
        fn(*args, **kwargs)
    return t


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --- matmul --------------------------------------------------------------------------------

def test_mm():
    t = tally(torch.mm, torch.randn(4, 5), torch.randn(5, 6))
    assert t.flops["matmul"] == 240  # 4*6*2*5
    assert op_flops(aten.mm.default, (meta(4, 5), meta(5, 6)), {}, meta(4, 6)) == \
        FlopCount("matmul", 240, 240)


def test_addmm_bias_not_counted():
    t = tally(torch.addmm, torch.randn(6), torch.randn(4, 5), torch.randn(5, 6), beta=2, alpha=3)
    assert dict(t.flops) == {"matmul": 240}  # 4*6*2*5; the bias add and alpha/beta are free


@pytest.mark.parametrize("fn, inputs", [
    (torch.bmm, [(3, 4, 5), (3, 5, 6)]),
    (torch.baddbmm, [(3, 4, 6), (3, 4, 5), (3, 5, 6)]),
    (torch.addbmm, [(4, 6), (3, 4, 5), (3, 5, 6)]),
])
def test_batched_matmul(fn, inputs):
    t = tally(fn, *[torch.randn(s) for s in inputs])
    assert t.flops["matmul"] == 720  # 3*4*6*2*5


def test_bilinear_trilinear_forward_and_backward():
    b = torch.nn.Bilinear(6, 7, 3)
    x1, x2 = torch.randn(4, 6, requires_grad=True), torch.randn(4, 7, requires_grad=True)
    with FlopTally() as fwd:
        y = b(x1, x2)
    with FlopTally() as bwd:
        y.sum().backward()
    assert fwd.flops["matmul"] == 2 * 4 * 3 * 6 * 7              # 1008: x1 W x2 over [B,O,I,J]
    assert bwd.flops["matmul"] == 3 * 1008                       # grads of x1, W and x2
    assert not fwd.uncounted and not bwd.uncounted


def test_matrix_vector_and_dot():
    assert tally(torch.mv, torch.randn(4, 5), torch.randn(5)).flops["matmul"] == 40  # 4*2*5
    assert tally(torch.addmv, torch.randn(4), torch.randn(4, 5),
                 torch.randn(5)).flops["matmul"] == 40  # 4*2*5
    assert tally(torch.dot, torch.randn(7), torch.randn(7)).flops["matmul"] == 14  # 2*7
    assert tally(torch.vdot, torch.randn(7), torch.randn(7)).flops["matmul"] == 14  # 2*7


def test_composites_through_their_decompositions():
    t = tally(torch.matmul, torch.randn(2, 3, 4, 5), torch.randn(5, 6))
    assert t.flops["matmul"] == 1440  # folded to mm (24,5)x(5,6): 24*6*2*5
    t = tally(torch.einsum, "bik,bkj->bij", torch.randn(3, 4, 5), torch.randn(3, 5, 6))
    assert t.flops["matmul"] == 720  # bmm: 3*4*6*2*5
    t = tally(F.linear, torch.randn(8, 16), torch.randn(32, 16), torch.randn(32))
    assert t.flops["matmul"] == 8192  # addmm: 8*32*2*16
    t = tally(torch.nn.Linear(16, 32), torch.randn(2, 8, 16))
    assert t.flops["matmul"] == 16384  # (2*8 tokens)*32*2*16
    assert not t.uncounted


def test_linear_backward_is_twice_forward():
    layer = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    with FlopTally() as fwd:
        y = layer(x)
    with FlopTally() as bwd:
        y.sum().backward()
    assert fwd.flops["matmul"] == 8192  # 8*32*2*16
    assert bwd.flops["matmul"] == 2 * 8192  # grad_input 2*8*16*32 + grad_weight 2*32*16*8
    assert fwd.flops["matmul"] + bwd.flops["matmul"] == 3 * fwd.flops["matmul"]
    assert bwd.flops["elementwise"] > 0  # the bias grad is a sum: elementwise, not matmul


def test_scaled_and_int_mm_direct_on_meta():
    a = meta(16, 32, dtype=torch.float8_e4m3fn)
    b = meta(32, 48, dtype=torch.float8_e4m3fn)
    cost = op_flops(aten._scaled_mm.default, (a, b, meta(()), meta(())),
                    {"out_dtype": torch.bfloat16}, meta(16, 48, dtype=torch.bfloat16))
    assert cost == FlopCount("matmul", 49152, 49152)  # 16*48*2*32
    cost = op_flops(aten._int_mm.default, (meta(16, 32, dtype=torch.int8),
                                           meta(32, 48, dtype=torch.int8)), {},
                    meta(16, 48, dtype=torch.int32))
    assert cost.flops == 49152  # 16*48*2*32


def test_grouped_mm_direct_on_meta():
    bf16 = torch.bfloat16
    offs = meta(3, dtype=torch.int32)
    # 2d x 3d (MoE): 12 token rows split over 3 experts (16 -> 8): 12*8*2*16
    cost = op_flops(aten._grouped_mm.default, (meta(12, 16, dtype=bf16),
                                               meta(3, 16, 8, dtype=bf16), offs), {}, None)
    assert cost.flops == 3072
    # 3d x 2d: 3 groups of (4,16) against their own share of 24 columns: 4*24*2*16
    cost = op_flops(aten._grouped_mm.default, (meta(3, 4, 16, dtype=bf16),
                                               meta(16, 24, dtype=bf16), offs), {}, None)
    assert cost.flops == 3072


def test_transformers_grouped_mm_fallback_custom_op():
    """transformers' MoE fallback: one custom op per grouped matmul; the mm calls inside it
    never reach a dispatch mode, so the op itself carries the formula."""
    moe = pytest.importorskip("transformers.integrations.moe")
    x = torch.randn(12, 16, requires_grad=True)         # 12 token rows, sorted by expert
    w = torch.randn(3, 16, 8, requires_grad=True)       # 3 experts, 16 -> 8
    offs = torch.tensor([4, 9, 12])                     # groups of 4, 5 and 3 rows
    # the Python body, traced op by op: 2*4*16*8 + 2*5*16*8 + 2*3*16*8 = 3072 = 2*12*16*8
    assert tally(moe._grouped_mm_fallback, x.detach(), w.detach(), offs).flops["matmul"] == 3072
    with FlopTally() as t:
        torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs).sum().backward()
    assert not t.uncounted
    fwd = [c for f, c in t.ops if f is torch.ops.transformers.grouped_mm_fallback.default]
    bwd = [c for f, c in t.ops if f is torch.ops.transformers.grouped_mm_fallback_backward.default]
    assert fwd == [FlopCount("matmul", 3072, 3072)]
    # grad_input 2*12*8*16 + grad_weight 2*16*12*8 = 6144
    assert bwd == [FlopCount("matmul", 6144, 6144)]
    # meta tensors, every argument by keyword
    cost = op_flops(torch.ops.transformers.grouped_mm_fallback.default, (),
                    {"input": meta(12, 16), "weight": meta(3, 16, 8), "offs": meta(3)}, None)
    assert cost == FlopCount("matmul", 3072, 3072)


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.integers(1, 4))
def test_matmul_property(m, k, n, b):
    a, w, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    assert tally(torch.mm, a, w).flops["matmul"] == 2 * m * k * n
    assert tally(torch.addmm, bias, a, w).flops["matmul"] == 2 * m * k * n
    t = tally(torch.bmm, torch.randn(b, m, k), torch.randn(b, k, n))
    assert t.flops["matmul"] == 2 * m * k * n * b


# --- convolution ---------------------------------------------------------------------------

CONVS = [  # (conv fn, input shape, weight shape, kwargs, forward FLOPs)
    # conv1d: out (2,5,7) = 70 elements, each 3*4 taps: 2*70*12
    (F.conv1d, (2, 3, 10), (5, 3, 4), {}, 1680),
    # conv2d, padding 1: out (2,4,8,8) = 512 elements, each 3*3*3 taps: 2*512*27
    (F.conv2d, (2, 3, 8, 8), (4, 3, 3, 3), {"padding": 1}, 27648),
    # stride 2, groups 2: out (2,6,4,4) = 192 elements, each (4/2)*3*3 taps: 2*192*18
    (F.conv2d, (2, 4, 8, 8), (6, 2, 3, 3), {"stride": 2, "padding": 1, "groups": 2}, 6912),
    # transposed, stride 2: each of 2*4*5*5 = 200 inputs meets 3*3*3 taps: 2*200*27
    (F.conv_transpose2d, (2, 4, 5, 5), (4, 3, 3, 3), {"stride": 2}, 10800),
    # transposed, groups 2: each of 36 inputs meets (2/2)*2*2 taps: 2*36*4
    (F.conv_transpose2d, (1, 4, 3, 3), (4, 1, 2, 2), {"groups": 2}, 288),
    # conv3d: out (1,3,3,3,3) = 81 elements, each 2*2*2*2 taps: 2*81*16
    (F.conv3d, (1, 2, 4, 4, 4), (3, 2, 2, 2, 2), {}, 2592),
]


@pytest.mark.parametrize("fn, x_shape, w_shape, kw, expected", CONVS)
def test_conv_forward_and_backward(fn, x_shape, w_shape, kw, expected):
    x = torch.randn(x_shape, requires_grad=True)
    w = torch.randn(w_shape, requires_grad=True)
    with FlopTally() as fwd:
        y = fn(x, w, **kw)
    with FlopTally() as bwd:
        y.sum().backward()
    assert fwd.flops["matmul"] == expected
    assert bwd.flops["matmul"] == 2 * expected  # grad_input + grad_weight, one forward each
    x.grad = w.grad = None
    y = fn(x.detach(), w, **kw)  # no grad_input wanted: output_mask[0] is False
    assert tally(y.sum().backward).flops["matmul"] == expected


def test_conv_backward_direct_output_mask_and_bias():
    args = (meta(2, 4, 8, 8), meta(2, 3, 8, 8), meta(4, 3, 3, 3), [4], [1, 1], [1, 1], [1, 1],
            False, [0, 0], 1)
    out = (meta(2, 3, 8, 8), meta(4, 3, 3, 3), meta(4))
    for mask, expected in [([True, True, True], 2 * 27648), ([False, True, True], 27648),
                           ([True, False, False], 27648), ([False, False, True], 0)]:
        assert op_flops(aten.convolution_backward.default, args + (mask,), {}, out).flops == \
            expected  # 27648 = the conv2d forward above; the bias grad is never matmul work


# --- attention -----------------------------------------------------------------------------

# q (2,8,5,16), k/v (2,8,7,16): 4*B*H*Sq*Sk*D = 4*2*8*5*7*16
DENSE = 35840
# Dv = 12: 2*B*H*Sq*Sk*Dqk + 2*B*H*Sq*Sk*Dv = 2*2*8*5*7*16 + 2*2*8*5*7*12 = 17920 + 13440
DENSE_DV12 = 31360


def _qkv(kv_heads=8, dv=16, requires_grad=False):
    return (torch.randn(2, 8, 5, 16, requires_grad=requires_grad),
            torch.randn(2, kv_heads, 7, 16, requires_grad=requires_grad),
            torch.randn(2, kv_heads, 7, dv, requires_grad=requires_grad))


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("kv_heads, causal", [(8, False), (8, True), (2, False), (2, True)])
def test_sdpa_cpu_forward_backward(fake, kv_heads, causal):
    with FakeTensorMode() if fake else nullcontext():
        q, k, v = _qkv(kv_heads, requires_grad=True)
        with FlopTally() as fwd:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                 enable_gqa=kv_heads != 8)
        with FlopTally() as bwd:
            out.sum().backward()
    assert [str(f) for f, _ in fwd.ops if _.kind == "attention"] == \
        ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert fwd.flops["attention"] == DENSE  # query heads, even with 2 KV heads (GQA)
    assert fwd.causal["attention"] == (DENSE // 2 if causal else DENSE)  # 17920 when causal
    assert bwd.flops["attention"] == 2 * DENSE  # backward = 2x forward, by convention
    assert bwd.causal["attention"] == (DENSE if causal else 2 * DENSE)
    assert fwd.flops["matmul"] == bwd.flops["matmul"] == 0


def test_sdpa_explicit_mask_is_dense():
    q, k, v = _qkv()
    mask = torch.ones(5, 7, dtype=torch.bool).tril()
    t = tally(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
    assert t.flops["attention"] == t.causal["attention"] == DENSE  # the mask content is unknown


def test_sdpa_math_fallback_counts_as_matmul():
    # Dqk != Dv has no CPU flash kernel: the math path runs two bmm, costed as matmul
    t = tally(F.scaled_dot_product_attention, *_qkv(dv=12))
    assert t.flops["matmul"] == DENSE_DV12 and t.flops["attention"] == 0


def _causal_pair(func, args, kwargs=None):
    cost = op_flops(func, args, kwargs or {}, None)
    assert cost.kind == "attention"
    return cost.flops, cost.flops_causal


@pytest.mark.parametrize("device, dropout", [("meta", 0.0), ("cpu", 0.1)])
def test_sdpa_math_path_called_past_the_wrapper_is_attention(device, dropout):
    """A reference to SDPA bound before the trace bypasses torchledger's wrapper; its math
    path (meta; dropout on cpu) is still recognised, by the softmax only SDPA uses."""
    import torchledger
    sdpa = F.scaled_dot_product_attention             # bound before the trace starts

    class A(torch.nn.Module):
        def forward(self, q):
            return sdpa(q, q, q, dropout_p=dropout).sum()

    with torch.device(device):
        q = torch.randn(2, 4, 16, 64, requires_grad=True)
        m = A()
        with torchledger.trace(m) as t:
            m(q).backward()
    tot = t.record.totals
    fwd = 4 * 2 * 4 * 16 * 16 * 64                    # 524288: scores and x V, 2*B*H*T*T*D each
    assert tot["flops"]["forward"] == fwd and tot["flops"]["backward"] == 2 * fwd
    assert tot["attention_flops"]["dense"] == 3 * fwd          # the whole step is attention
    assert not [o for o in t.record.ops if o["kind"] == "matmul" and o["flops"]]
    assert t.record.meta["attention_kernels"] == ["SDPA math path (bmm + softmax)"]


def test_sdpa_cuda_entry_points_bhsd_meta():
    q, k, v, v12 = meta(2, 8, 5, 16), meta(2, 8, 7, 16), meta(2, 8, 7, 16), meta(2, 8, 7, 12)
    g = meta(2, 8, 5, 16)
    lse, seed = meta(2, 8, 5), meta(2, dtype=torch.int64)
    assert _causal_pair(aten._scaled_dot_product_flash_attention.default,
                        (q, k, v, 0.0, True)) == (DENSE, DENSE // 2)
    assert _causal_pair(aten._scaled_dot_product_flash_attention.default,
                        (q, k, v), {"scale": 0.5}) == (DENSE, DENSE)
    assert _causal_pair(aten._scaled_dot_product_flash_attention.default,
                        (q, k, v), {"is_causal": True}) == (DENSE, DENSE // 2)
    assert _causal_pair(aten._scaled_dot_product_efficient_attention.default,
                        (q, k, v12, None, True, 0.0, True)) == (DENSE_DV12, DENSE_DV12 // 2)
    assert _causal_pair(aten._scaled_dot_product_cudnn_attention.default,
                        (q, k, v, meta(5, 7), False, 0.0, False)) == (DENSE, DENSE)
    assert _causal_pair(aten._scaled_dot_product_fused_attention_overrideable.default,
                        (q, k, v12, None, 0.0, True)) == (DENSE_DV12, DENSE_DV12 // 2)
    # backward: 2x forward
    assert _causal_pair(aten._scaled_dot_product_flash_attention_backward.default,
                        (g, q, k, v, g, lse, None, None, 5, 7, 0.0, True, seed, seed)) == \
        (2 * DENSE, DENSE)
    assert _causal_pair(aten._scaled_dot_product_efficient_attention_backward.default,
                        (g, q, k, v12, None, meta(2, 8, 5, 12), lse, seed, seed, 0.0,
                         [True, True, True, False], False)) == (2 * DENSE_DV12, 2 * DENSE_DV12)
    assert _causal_pair(aten._scaled_dot_product_cudnn_attention_backward.default,
                        (g, q, k, v, g, lse, seed, seed, None, None, None, 5, 7, 0.0, True)) == \
        (2 * DENSE, DENSE)
    assert _causal_pair(aten._scaled_dot_product_fused_attention_overrideable_backward.default,
                        (g, q, k, v, None, [True] * 4, g, lse, None, None, 5, 7, 0.0, False,
                         seed, seed)) == (2 * DENSE, 2 * DENSE)


def test_flash_attention_forward_bshd_gqa_meta():
    # (B, S, H, D) layout: q (2,5,8,16), k/v (2,7,2,16) with 2 KV heads -> same as DENSE
    q, k, v = meta(2, 5, 8, 16), meta(2, 7, 2, 16), meta(2, 7, 2, 16)
    args = (q, k, v, None, None, 5, 7, 0.0, False, False)
    assert _causal_pair(aten._flash_attention_forward.default, args) == (DENSE, DENSE)
    args = (q, k, v, None, None, 5, 7, 0.0, True, False)
    assert _causal_pair(aten._flash_attention_forward.default, args) == (DENSE, DENSE // 2)
    bwd = (q, q, k, v, q, meta(2, 8, 5), None, None, 5, 7, 0.0, True, meta(2), meta(2))
    assert _causal_pair(aten._flash_attention_backward.default, bwd) == (2 * DENSE, DENSE)


# varlen: 3 sequences, q lengths 3,5,2 (10 tokens), k lengths 4,6,2 (12 tokens);
# sum Sq_i*Sk_i = 3*4 + 5*6 + 2*2 = 46 pairs; 8 query heads, Dqk = Dv = 16:
# 2*Hq*pairs*(Dqk+Dv) = 2*8*46*32
VARLEN = 23552
# with meta offsets only bounds are known: min(Tq*Tk=120, Tq*max_k=60, max_q*Tk=60,
# n*max_q*max_k=90) = 60 pairs: 2*8*60*32
VARLEN_BOUND = 30720


@pytest.mark.parametrize("device, expected", [("cpu", VARLEN), ("meta", VARLEN_BOUND)])
def test_flash_attention_varlen(device, expected):
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 10, 12], dtype=torch.int32, device=device)
    q, k, v = meta(10, 8, 16), meta(12, 2, 16), meta(12, 2, 16)
    args = (q, k, v, cu_q, cu_k, 5, 6, 0.0, True, False)
    assert _causal_pair(aten._flash_attention_forward.default, args) == \
        (expected, expected // 2)
    bwd = (q, q, k, v, q, meta(8, 10), cu_q, cu_k, 5, 6, 0.0, False, meta(2), meta(2))
    assert _causal_pair(aten._flash_attention_backward.default, bwd) == \
        (2 * expected, 2 * expected)


def test_varlen_bound_is_exact_for_equal_lengths():
    cu_q = torch.tensor([0, 4, 8], device="meta")  # 2 sequences of q 4, k 6: 2*4*6 = 48 pairs
    cu_k = torch.tensor([0, 6, 12], device="meta")
    args = (meta(8, 8, 16), meta(12, 8, 16), meta(12, 8, 16), cu_q, cu_k, 4, 6, 0.0, False,
            False)
    assert op_flops(aten._flash_attention_forward.default, args, {}, None).flops == \
        24576  # 2*8*48*32


def test_efficient_attention_forward_backward_meta():
    # (B, S, H, D): q (2,5,8,16), k (2,7,8,16), v (2,7,8,12) -> DENSE_DV12
    q, k, v = meta(2, 5, 8, 16), meta(2, 7, 8, 16), meta(2, 7, 8, 12)
    fwd = aten._efficient_attention_forward.default
    for mask_type, causal in [(0, DENSE_DV12), (1, DENSE_DV12 // 2), (2, DENSE_DV12 // 2)]:
        args = (q, k, v, None, None, None, None, None, 0.0, mask_type)
        assert _causal_pair(fwd, args) == (DENSE_DV12, causal)
    bwd = (meta(2, 5, 8, 12), q, k, v, None, meta(2, 5, 8, 12), None, None, 5, 7,
           meta(2, 8, 5), 0.0, meta(()), meta(()), 1, False)
    assert _causal_pair(aten._efficient_attention_backward.default, bwd) == \
        (2 * DENSE_DV12, DENSE_DV12)
    # varlen: batch 1, packed (1, T, H, D) with cu_seqlens, same 46 pairs as above
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    args = (meta(1, 10, 8, 16), meta(1, 12, 8, 16), meta(1, 12, 8, 16), None, cu_q, cu_k,
            5, 6, 0.0, 0)
    assert _causal_pair(fwd, args) == (VARLEN, VARLEN)


def test_cudnn_attention_forward_dense_and_varlen_meta():
    q, k, v = meta(2, 8, 5, 16), meta(2, 8, 7, 16), meta(2, 8, 7, 16)
    args = (q, k, v, None, None, None, 5, 7, False, 0.0, True)
    assert _causal_pair(aten._cudnn_attention_forward.default, args) == (DENSE, DENSE // 2)
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    args = (meta(10, 8, 16), meta(12, 2, 16), meta(12, 2, 16), None, cu_q, cu_k, 5, 6, False)
    assert _causal_pair(aten._cudnn_attention_forward.default, args) == (VARLEN, VARLEN)


# --- element-wise --------------------------------------------------------------------------

def test_elementwise_examples():
    x = torch.randn(3, 4)
    assert dict(tally(torch.relu, x).flops) == {"elementwise": 12}  # 3*4 outputs
    assert tally(torch.add, x, torch.randn(4)).flops["elementwise"] == 12  # broadcast: 3*4 out
    assert tally(x.add_, 1.0).flops["elementwise"] == 12  # in place
    assert tally(torch.sum, x).flops["elementwise"] == 12  # reduction: 3*4 inputs
    assert tally(torch.softmax, x, -1).flops["elementwise"] == 12  # _softmax: 3*4 inputs
    ln = torch.nn.LayerNorm(4)
    assert tally(ln, torch.randn(2, 3, 4)).flops == {"elementwise": 24}  # 2*3*4 inputs
    t = tally(F.cross_entropy, torch.randn(4, 10), torch.tensor([1, 2, 3, 4]))
    assert t.flops["elementwise"] == 44  # log_softmax 4*10 + nll_loss 4 targets
    t = tally(torch._foreach_add_, [torch.randn(3), torch.randn(2, 2)], 1.0)
    assert t.flops["elementwise"] == 7  # 3 + 2*2
    assert not t.uncounted
    # floor_divide carries no pointwise tag in torch; MoE routing uses it
    t = tally(torch.floor_divide, torch.arange(12).view(3, 4), torch.full((4,), 5))
    assert dict(t.flops) == {"elementwise": 12} and not t.uncounted  # 3*4 outputs
    t = tally(torch.arange(6).floor_divide_, 4)
    assert dict(t.flops) == {"elementwise": 6} and not t.uncounted  # 6 outputs, in place


def test_embedding_is_free_and_its_backward_elementwise():
    emb = torch.nn.Embedding(10, 4)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with FlopTally() as fwd:
        y = emb(idx)
    with FlopTally() as bwd:
        y.sum().backward()
    assert [(str(f), c.kind) for f, c in fwd.ops] == [("aten.embedding.default", "free")]
    emb_bwd = [c for f, c in bwd.ops if f is aten.embedding_dense_backward.default]
    assert emb_bwd == [FlopCount("elementwise", 24, 24)]  # scatter-add of 2*3*4 grads


def test_fused_adamw_matches_foreach_path():
    def step(**kw):
        params = [torch.nn.Parameter(torch.randn(10, 10)), torch.nn.Parameter(torch.randn(10))]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, **kw)
        opt.step()  # first step creates the state
        return tally(opt.step)

    fused, foreach = step(fused=True), step(foreach=True)
    fused_adamw = [c for f, c in fused.ops if f is aten._fused_adamw_.default]
    # 110 elements x (7 passes + 1 for weight decay 0.01) = 880
    assert fused_adamw == [FlopCount("elementwise", 880, 880)]
    # both paths also bump the two step counters (_foreach_add_): 880 + 2
    assert fused.flops["elementwise"] == foreach.flops["elementwise"] == 882
    assert not fused.uncounted and not foreach.uncounted


class TinyGPT(torch.nn.Module):
    """One pre-norm block: every matmul input requires grad except the token ids."""

    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("fused", [False, True])
def test_training_step_fully_counted(fused):
    model = TinyGPT()
    idx, targets = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    opt = torch.optim.AdamW(model.parameters(), fused=fused, foreach=not fused)
    with FlopTally() as fwd:
        loss = model(idx, targets)
    with FlopTally() as rest:
        loss.backward()
        opt.step()
        opt.zero_grad()
    # matmul weights: 32*96 + 32*32 + 32*128 + 128*32 + 32*50 = 13888; 16 tokens: 2*16*13888
    assert fwd.flops["matmul"] == 444416
    # 4*B*H*T*T*dh = 4*2*4*8*8*8, half of it causal
    assert (fwd.flops["attention"], fwd.causal["attention"]) == (16384, 8192)
    assert rest.flops["matmul"] == 2 * 444416 and rest.flops["attention"] == 2 * 16384
    assert not fwd.uncounted and not rest.uncounted


# --- recurrent layers ----------------------------------------------------------------------

def _rnn_step(make, x, device):
    """(forward tally, backward tally) of one nn.LSTM/GRU/RNN step on ``device``."""
    with FakeTensorMode() if device == "fake" else torch.device(device):
        rnn, xx = make(), x()
        with FlopTally() as fwd:
            out = rnn(xx)[0]
        with FlopTally() as bwd:
            out.sum().backward()
    return fwd, bwd


# LSTM(8, 16), x [T=5, B=2, 8]: rows 10; w_ih 64x8 = 512, w_hh 64x16 = 1024
LSTM_FWD = 2 * 10 * (512 + 1024)    # = 30720
# 2 layers, bidirectional: layer 0 per direction 512 + 1024, layer 1 per direction w_ih 64x32
# = 2048 + 1024: 2 * 10 * 2 * (1536 + 3072)
LSTM2BI_FWD = 2 * 10 * 2 * (1536 + 3072)    # = 184320


@pytest.mark.parametrize("device", ["cpu", "fake"])
@pytest.mark.parametrize("layers, bidirectional, fwd", [(1, False, LSTM_FWD), (2, True, LSTM2BI_FWD)])
def test_lstm_fused_onednn_kernel(device, layers, bidirectional, fwd):
    f, b = _rnn_step(lambda: torch.nn.LSTM(8, 16, num_layers=layers, bidirectional=bidirectional),
                     lambda: torch.randn(5, 2, 8), device)
    assert {str(func) for func, _ in f.ops} >= {"aten.mkldnn_rnn_layer.default"}
    assert f.flops["matmul"] == fwd
    assert b.flops["matmul"] == 2 * fwd   # oneDNN makes every gradient, the input's too
    assert not f.uncounted and not b.uncounted


def test_lstm_decomposed_on_meta_matches_the_fused_forward():
    # no oneDNN on meta: the same LSTM runs as addmm/mm per step; forward work is identical.
    # Backward skips the first step's grad w.r.t. h0 (zeros, no grad): 2*B*w_hh = 2*2*1024
    f, b = _rnn_step(lambda: torch.nn.LSTM(8, 16), lambda: torch.randn(5, 2, 8), "meta")
    assert f.flops["matmul"] == LSTM_FWD
    # dW_ih (2*10*512) + dW_hh (2*10*1024) + dh through w_hh for steps 2..5 (2*8*1024);
    # the input needs no grad, so no dx
    assert b.flops["matmul"] == 2 * 10 * 512 + 2 * 10 * 1024 + 2 * 8 * 1024
    assert not f.uncounted and not b.uncounted


@pytest.mark.parametrize("cell, gates", [(torch.nn.GRU, 3), (torch.nn.RNN, 1)])
def test_gru_and_rnn_decompose_into_counted_matmuls(cell, gates):
    f, b = _rnn_step(lambda: cell(8, 16), lambda: torch.randn(5, 2, 8), "cpu")
    # w_ih (gates*16)x8, w_hh (gates*16)x16, 10 rows: 2 * 10 * gates*16 * 24
    assert f.flops["matmul"] == 2 * 10 * gates * 16 * 24
    assert not f.uncounted and not b.uncounted


def _cudnn_args(proj=0):
    """_cudnn_rnn for a 1-layer LSTM(8, 16) on x [5, 2, 8] (optionally with projections)."""
    ws = [meta(64, 8), meta(64, 16 if not proj else proj), meta(64), meta(64)]
    if proj:
        ws.append(meta(proj, 16))       # w_hr
    buf = meta(sum(w.numel() for w in ws))
    h = proj or 16
    return (meta(5, 2, 8), ws, len(ws), buf, meta(1, 2, h), meta(1, 2, 16), 2, 16, proj, 1,
            False, 0.0, True, False, [], None)


def test_cudnn_rnn_forward_and_backward_on_meta():
    args = _cudnn_args()
    out = aten._cudnn_rnn.default(*args)
    assert op_flops(aten._cudnn_rnn.default, args, {}, out) == FlopCount("matmul", LSTM_FWD, LSTM_FWD)
    # with projections to 4: w_hh 64x4 = 256, w_hr 4x16 = 64: 2 * 10 * (512 + 256 + 64)
    pargs = _cudnn_args(proj=4)
    assert op_flops(aten._cudnn_rnn.default, pargs, {}, None).flops == 2 * 10 * 832
    # backward(input, weight, weight_stride0, weight_buf, hx, cx, output, grad_output, grad_hy,
    #          grad_cy, mode, hidden, proj, layers, batch_first, dropout, train, bidir,
    #          batch_sizes, dropout_state, reserve, output_mask)
    bw = (args[0], args[1], 4, args[3], args[4], args[5], out[0], out[0], None, None, 2, 16, 0, 1,
          False, 0.0, True, False, [], None, out[3])
    for mask, passes in [([True, True, True, True], 2), ([True, True, True, False], 1)]:
        assert op_flops(aten._cudnn_rnn_backward.default, bw + (mask,), {}, None).flops == \
            passes * LSTM_FWD


def test_fused_cell_kernels_are_elementwise():
    # nn.LSTMCell on CUDA: two linears (counted as mm) and a fused gate kernel: 1 per gate element
    gates = meta(2, 64)
    c = op_flops(aten._thnn_fused_lstm_cell.default, (gates, gates, meta(2, 16)), {}, None)
    assert c == FlopCount("elementwise", 128, 128)   # 2*64


# --- free and unknown ----------------------------------------------------------------------

def test_free_ops():
    x = torch.randn(3, 4)
    for fn in (lambda: x.view(12), lambda: x.t(), lambda: x.transpose(0, 1), x.clone,
               x.detach, lambda: torch.cat([x, x]), lambda: torch.zeros(3),
               lambda: x.to(torch.float64), lambda: x.tril(),
               lambda: F.embedding(torch.tensor([0, 2]), x)):
        t = tally(fn)
        assert t.ops and all(c.kind == "free" and c.flops == 0 for _, c in t.ops), t.ops
    a = op_flops(aten.view.default, (meta(3, 4), [12]), {}, meta(12))
    b = op_flops(aten.clone.default, (meta(3, 4),), {}, meta(3, 4))
    assert a is b == FlopCount("free", 0, 0)  # one shared instance: nothing allocated


@pytest.fixture(scope="module")
def custom_op():
    lib = torch.library.Library("tl_flops_test", "DEF")
    lib.define("mystery(Tensor x) -> Tensor")
    lib.impl("mystery", lambda x: x * 2, "CPU")
    yield torch.ops.tl_flops_test.mystery.default
    lib._destroy()


def test_unknown_ops_are_none(custom_op):
    t = tally(custom_op, torch.randn(3))
    assert dict(t.uncounted) == {"tl_flops_test.mystery.default": 1}
    x = meta(4, 4)
    assert op_flops(aten._linalg_svd.default, (x,), {}, (x, meta(4), x)) is None
    assert op_flops(aten.topk.default, (x, 2), {}, (meta(4, 2), meta(4, 2))) is None


def test_custom_op_counted_by_the_formula_registered_with_pytorch():
    """A custom op's author may register its cost with torch.utils.flop_counter; torchledger
    uses it (FlopCounterMode does too), and the op's weight counts in N."""
    import torchledger
    from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

    lib = torch.library.Library("tl_flops_reg", "DEF")
    lib.define("mylinear(Tensor x, Tensor w) -> Tensor")
    lib.impl("mylinear", lambda x, w: x @ w.t(), "CPU")
    op = torch.ops.tl_flops_reg.mylinear
    try:
        @register_flop_formula(op)
        def _cost(x_shape, w_shape, *, out_shape=None, **kwargs):
            return 2 * x_shape[0] * x_shape[1] * w_shape[0]

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(6, 5))

            def forward(self, x):
                return op(x, self.w).sum()

        m, x = M(), torch.randn(4, 5)
        with torchledger.trace(m, tokens=4) as t:
            m(x)
        assert t.record.totals["flops"]["forward"] == 240              # 2*4*5*6
        assert t.record.totals["matmul_params"] == 30 and not t.record.uncounted_ops
        with FlopCounterMode(display=False) as ref:
            m(x)
        assert ref.get_total_flops() == 240
    finally:
        flop_registry.pop(op, None)
        lib._destroy()


def test_cache_resolves_each_overload_once():
    from torchledger.tracer import flops

    a, b = meta(2, 3), meta(3, 4)
    op_flops(aten.mm.default, (a, b), {}, None)
    handler = flops._HANDLERS[id(aten.mm.default)]
    assert op_flops(aten.mm.default, (a, b), None, None).flops == 48  # 2*4*2*3
    assert flops._HANDLERS[id(aten.mm.default)] is handler


def test_matrices_gathered_from_a_weight_stack_count_as_that_weight():
    """MoE's batched path picks each token's expert matrices out of a [E, out, in] weight and
    multiplies them with bmm: N counts the stack; rows picked from a 2-D table (an embedding)
    are an input, never a weight."""
    import torchledger

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 6, 5))        # 4 experts, 5 -> 6
            self.table = torch.nn.Parameter(torch.randn(10, 5))      # an embedding-like table

        def forward(self, ids, expert_ids):
            x = self.table[ids]                                      # (3, 5): rows of a 2-D table
            w = self.w[expert_ids]                                   # (3, 6, 5): one matrix per token
            return torch.bmm(w, x[:, :, None]).sum()

    m = Experts()
    with torchledger.trace(m, tokens=3) as t:
        m(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 2])).backward()
    assert t.record.totals["matmul_params"] == 4 * 6 * 5                 # the stack, not the table
    assert t.record.totals["param_matmul_flops_forward"] == 2 * 3 * 6 * 5   # 180: 3 tokens x 6x5


def test_recurrent_weights_are_matmul_params_in_6nd():
    import torchledger

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.rnn = torch.nn.LSTM(8, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 20, bias=False)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0]).float().mean()

    m = Tagger()
    with torchledger.trace(m, tokens=10) as t:
        m(torch.randint(0, 20, (2, 5))).backward()
    # w_ih 64x8 + w_hh 64x16 + head 20x16 = 512 + 1024 + 320 (biases and the lookup excluded)
    assert t.record.totals["matmul_params"] == 1856
    assert t.record.totals["flops"]["total"] == 6 * 1856 * 10     # 6ND exactly (oneDNN: dx too)
    assert not t.record.uncounted_ops


def test_params_sharing_one_storage_all_count_when_it_is_multiplied():
    # cuDNN's flatten_parameters() makes every weight of an RNN a view of one flat buffer; the
    # fused kernel reads them all: N must hold every one of them, not the last registered.
    import torchledger

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            buf = torch.randn(4 * 6 + 6 * 3)
            self.a = torch.nn.Parameter(buf[:24].view(4, 6))
            self.b = torch.nn.Parameter(buf[24:].view(6, 3))

        def forward(self, x):
            return (x @ self.a @ self.b).sum()

    m = Flat()
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()
    with torchledger.trace(m, tokens=2) as t:
        m(torch.randn(2, 4))
    assert t.record.totals["matmul_params"] == 24 + 18
