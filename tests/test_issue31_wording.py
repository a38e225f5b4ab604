"""Report wording that told new users something false (issue 31, item 8), each on a tiny model of
the shape that showed it:

* "its 2th of the heads" under tensor parallelism (a tiny GPT-2 on --mesh tp=2);
* "163M dense, 163M causal-halved" on a UNet's non-causal cross-attention (a UNet-like block
  with multi-head cross-attention, and a bidirectional encoder for the 12LTd row);
* Gemma-2's gated GeGLU MLP called "gelu" (a Gemma-like model with a config, and Gemma-2);
* "(fusable: --compiled saves 81%)" where the percent was of the whole step and sat inside the
  memory-bound item (a tiny GPT-2's step, launch-bound);
* "(float32)" in the header and "measured in float32" under --precision bf16-mixed;
* "attention as flash (SDPA's choice for 16-bit inputs)" for an fp32 step: PyTorch's
  sdp_utils.cpp gives fp32 inputs the memory-efficient kernel (flash and cuDNN take fp16/bf16
  only), or the math path, and the pricing now follows the claim.

Every audit runs one step on fake tensors (timing steps off).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from torchledger.steptime.predict import attention_kernels, predict_step_time
from torchledger.audit.engine import run_audit
from torchledger.cli import cli
from torchledger.formulas import steptime as st
from torchledger.formulas.hardware import get_gpu
from torchledger.record import StepRecord, attention_ran_causal, compute_dtype

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "examples", "gpt2_tiny.py")

MODELS = '''\
import torch, torchledger
from torch import nn
import torch.nn.functional as F

class CrossAttn(nn.Module):
    # a UNet transformer block's cross-attention: image tokens attend the text, no mask, not causal
    def __init__(self, c, ctx, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = nn.Linear(c, c), nn.Linear(ctx, c), nn.Linear(ctx, c), nn.Linear(c, c)
    def forward(self, x, ctx):
        B, C, H, W = x.shape
        h = x.flatten(2).transpose(1, 2)                                        # [B, HW, C]
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)     # [B, heads, L, C/heads]
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(ctx)), split(self.v(ctx)))
        return x + self.o(a.transpose(1, 2).flatten(2)).transpose(1, 2).reshape(B, C, H, W)

class TinyUNet(nn.Module):
    def __init__(self, c=16, ctx=32):
        super().__init__()
        self.inp = nn.Conv2d(4, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.attn = CrossAttn(2 * c, ctx)
        self.up = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1)
        self.out = nn.Conv2d(c, 4, 3, padding=1)
    def forward(self, sample, encoder_hidden_states):
        h = self.attn(F.silu(self.down(self.inp(sample))), encoder_hidden_states)
        return self.out(F.silu(self.up(h)))

def unet():
    return torchledger.AuditSpec(TinyUNet(), {"sample": torch.randn(2, 4, 8, 8),
                                              "encoder_hidden_states": torch.randn(2, 8, 32)},
                                 loss_fn=lambda o, i: o.float().pow(2).mean())

class UNet3D(TinyUNet):
    # the same block calling SDPA on 3-D [B, L, C] tensors, as diffusers' single-head blocks can
    def forward(self, sample, encoder_hidden_states):
        h = F.silu(self.down(self.inp(sample)))
        B, C, H, W = h.shape
        x = h.flatten(2).transpose(1, 2)
        a = F.scaled_dot_product_attention(self.attn.q(x), self.attn.k(encoder_hidden_states),
                                           self.attn.v(encoder_hidden_states))
        h = h + self.attn.o(a).transpose(1, 2).reshape(B, C, H, W)
        return self.out(F.silu(self.up(h)))

def unet3d():
    spec = unet()
    return torchledger.AuditSpec(UNet3D(), spec.inputs, loss_fn=spec.loss_fn)

class EncoderBlock(nn.Module):
    # a bidirectional (BERT/ViT-like) block: self-attention, is_causal=False
    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))

class TinyEncoder(nn.Module):
    def __init__(self, V=64, d=32, L=2):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.blocks = nn.ModuleList([EncoderBlock(d) for _ in range(L)])
        self.head = nn.Linear(d, V, bias=False)
    def forward(self, ids, labels):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

def encoder():
    ids = torch.randint(0, 64, (2, 16))
    return torchledger.AuditSpec(TinyEncoder(), {"ids": ids, "labels": ids})
'''

_CACHE: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("wording") / "models.py"
    path.write_text(MODELS)
    return str(path)


def _audit(path, entry="audit_spec", **kw):
    key = (path, entry, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = run_audit(path, entry=entry, device="fake", steps=1, timing_steps=0, **kw).record
    return _CACHE[key]


def _cli(tmp_path, *args):
    """``audit ARGS --format json`` then ``report`` of that record: (record, report text)."""
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    res = CliRunner().invoke(cli, ["audit", *args, "--steps", "1", "--format", "json", "--output", str(out)])
    assert res.exit_code in (0, 1), res.output
    rec = StepRecord.from_dict(json.loads(out.read_text()))
    res = CliRunner().invoke(cli, ["report", str(out)])
    assert res.exit_code == 0, res.output
    return rec, res.output


def _rows(rec):
    return {r["quantity"]: r for r in (rec.predictions or {}).get("comparisons") or []}


# --- "its 2th of the heads" -------------------------------------------------------------------------

def test_tensor_parallel_share_of_heads_has_no_ordinal(tmp_path):
    rec, report = _cli(tmp_path, TINY, "--mesh", "tp=2")
    assert rec.totals["tensor_parallel"] == 2
    text = _rows(rec)["training FLOPs vs 6ND + 12LTd"]["explanation"]
    assert "tensor parallel 2: N is this rank's part of the split weights, the attention term its share " \
           "of the heads (1/2)" in text
    assert "2th" not in report and "th of the heads" not in report


# --- "163M dense, 163M causal-halved" on attention that never ran causal --------------------------

def test_unet_cross_attention_says_it_ran_dense(models):
    rec = _audit(models, "unet")
    attn = rec.totals["attention_flops"]
    # 2 samples x 2 heads x 16 queries (the 4x4 down-sampled image) x 8 keys x (16 + 16) head dims
    # x 2 (multiply-add) = 32,768 forward; backward 2x: 98,304 in all, none of it causal
    assert attn["dense"] == attn["causal"] == 3 * 2 * 2 * 2 * 16 * 8 * (16 + 16) == 98_304
    assert attention_ran_causal(rec) is False
    from torchledger.render.table import render_table
    text = render_table(rec, [])
    line = next(x for x in text.splitlines() if x.startswith("attention:"))
    assert line.startswith("attention: 98.3K counted dense (no kernel ran causal: nothing to halve);")
    assert "causal-halved" not in text        # the conventions line says "counted dense (no causal discount"
    assert "attention counted dense (no causal discount" in text


def test_bidirectional_encoder_has_no_causal_prediction(models):
    rec = _audit(models, "encoder")
    assert attention_ran_causal(rec) is False
    row = _rows(rec)["training FLOPs vs 6ND + 12LTd"]
    assert row["ratio"] == 1.0
    assert row["explanation"].startswith("attention counted dense, as it ran (no kernel ran causal: "
                                         "no causal-halved prediction applies)")


def test_causal_decoder_still_gives_both_figures():
    rec = _audit(TINY)
    attn = rec.totals["attention_flops"]
    # 2 layers x 4 sequences x 4 heads x 64 x 64 pairs x (16 + 16) x 2, forward; x 3 with backward
    assert attn["dense"] == 3 * 2 * 4 * 4 * 64 * 64 * 32 * 2 == 25_165_824
    assert attn["causal"] * 2 == attn["dense"] and attention_ran_causal(rec) is True
    from torchledger.render.common import attention_text
    assert attention_text(rec) == "25.2M counted dense, 12.6M with the causal kernels' masked half left out"
    assert "causal-halved prediction" in _rows(rec)["training FLOPs vs 6ND + 12LTd"]["explanation"]


# --- Gemma's gated GeGLU is not "gelu" ---------------------------------------------------------------

class _GemmaLikeConfig:
    # what the shape recogniser reads off a Hugging Face config; Gemma names hidden_activation
    model_type = "gemma2"
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 32, 2, 4, 2
    intermediate_size, vocab_size, head_dim, rms_norm_eps = 64, 128, 16, 1e-6

    def __init__(self, act="gelu_pytorch_tanh", field="hidden_activation"):
        setattr(self, field, act)


class _GatedMLP(torch.nn.Module):
    def __init__(self, d=32, ff=64, gated=True):
        super().__init__()
        if gated:
            self.gate_proj = torch.nn.Linear(d, ff, bias=False)
        self.up_proj = torch.nn.Linear(d, ff, bias=False)
        self.down_proj = torch.nn.Linear(ff, d, bias=False)


class _GemmaLike(torch.nn.Module):
    def __init__(self, cfg, gated=True):
        super().__init__()
        self.config = cfg
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": _GatedMLP(gated=gated)})
                                           for _ in range(2)])


@pytest.mark.parametrize("act, field, gated, kind", [
    ("gelu_pytorch_tanh", "hidden_activation", True, "geglu"),   # Gemma, Gemma 2 and 3
    ("gelu_new", "dense_act_fn", True, "geglu"),                 # T5 v1.1's gated-gelu
    ("silu", "hidden_act", True, "swiglu"),                      # Llama, Mistral, Qwen
    ("gelu_new", "hidden_act", False, "gelu"),                   # GPT-2's up/down MLP
])
def test_mlp_kind_from_structure_and_activation(act, field, gated, kind):
    from torchledger.tracer.shape import model_config
    model = _GemmaLike(_GemmaLikeConfig(act, field), gated=gated)
    assert model_config(model)["mlp"] == kind


def test_geglu_counts_three_matrices():
    from torchledger.formulas.params import count_params
    from torchledger.models import build_model
    from torchledger.models.config import TransformerConfig
    cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48, mlp="geglu",
                            norm="rmsnorm", bias=False, tie_embeddings=True)
    assert cfg.gated
    # per layer: attention 4 x 32 x 32 = 4,096, MLP 3 x 32 x 48 = 4,608, two norms 2 x 32 = 64;
    # 2 layers = 17,536, + embedding 64 x 32 = 2,048 + final norm 32 = 19,616
    assert count_params(cfg).total == 2 * (4 * 32 * 32 + 3 * 32 * 48 + 2 * 32) + 64 * 32 + 32 == 19_616
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == 19_616
    out = model.blocks[0].mlp(torch.ones(1, 2, 32))          # the GELU gate runs
    assert out.shape == (1, 2, 32)


def test_gemma2_is_named_geglu():
    pytest.importorskip("transformers")
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from torchledger.tracer.shape import model_config
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    assert model_config(Gemma2ForCausalLM(cfg))["mlp"] == "geglu"    # was "gelu"


# --- "(fusable: --compiled saves 81%)": of what -------------------------------------------------------

def test_fusable_is_the_steps_saving_and_says_so():
    rec = _audit(TINY)
    eager = predict_step_time(rec, "h100", {})
    compiled = predict_step_time(rec, "h100", {"kernels": "compiled"})
    # what fusion saves is exactly the step the compiled pricing predicts less
    saved = eager["seconds"] - compiled["seconds"]
    assert eager["fusable_seconds"] == pytest.approx(saved, rel=1e-9)
    assert 0 <= eager["fusable_launch_seconds"] <= eager["fusable_seconds"]
    pct = round(100 * saved / eager["seconds"])
    assert pct >= 1
    bound = eager["bound"]
    assert f"; --compiled would save {pct}% of the step" in bound
    assert "fusable:" not in bound
    # this step is launch-bound: the saving is in the kernels fusion removes, and it says so
    # even though the memory-bound item itself is under 0.5% of the step (once left out with it)
    assert eager["fusable_launch_seconds"] > 0.9 * eager["fusable_seconds"]
    assert bound.endswith(f"--compiled would save {pct}% of the step, in kernel launches")
    assert "would save" not in compiled["bound"]


# --- --precision bf16-mixed: the compute dtype as measured ------------------------------------------

def test_mixed_precision_header_and_activation_row(tmp_path):
    rec, report = _cli(tmp_path, TINY, "--world-size", "2", "--precision", "bf16-mixed")
    assert rec.meta["dtype"] == "float32" and not rec.meta.get("autocast")   # FSDP's policy, no autocast
    assert compute_dtype(rec) == ("bfloat16", "--precision bf16-mixed")
    head = report.splitlines()[0]
    assert "(float32 weights, bfloat16 compute under --precision bf16-mixed)" in head, head
    row = _rows(rec)["activation bytes vs Korthikanti (16-bit)"]["explanation"]
    assert "measured in bfloat16 compute under --precision bf16-mixed (float32 weights)" in row
    assert "measured in float32" not in report


def test_fp32_says_float32():
    rec = _audit(TINY)
    assert compute_dtype(rec) == ("float32", "matmuls")
    from torchledger.render.table import render_table
    assert "(float32), torch" in render_table(rec, []).splitlines()[0]
    assert "measured in float32;" in _rows(rec)["activation bytes vs Korthikanti (16-bit)"]["explanation"]


# --- fp32 attention on a GPU: memory-efficient or math, not flash -------------------------------------

def test_sdpa_kernel_rules_from_sdp_utils():
    h100, v100 = get_gpu("h100"), get_gpu("v100")
    assert st.sdpa_kernel("bf16", h100) == "flash"
    assert st.sdpa_kernel("fp32", h100, d=64, dv=64) == "efficient"
    # minimum_gemm_alignment: 4 elements for fp32 with tensor cores (sm80 on), 1 before
    assert st.sdpa_kernel("fp32", h100, d=66, dv=66) == "math"
    assert st.sdpa_kernel("fp32", v100, d=66, dv=66) == "efficient"
    assert st.sdpa_kernel("fp16", v100, d=64) == "efficient"       # no flash on a V100


def test_fp32_efficient_attention_by_hand():
    gpu = get_gpu("h100")
    eff = st.efficiency(gpu)
    got = st.attention_seconds(8, 16, 4096, 4096, 128, 128, False, False, "fp32", gpu)
    # FLOPs 2 x 8 x 16 x 4096 x 4096 x (128 + 128) = 1,099,511,627,776; the kernel runs 3xTF32:
    # peak 494.7 / 3 = 164.9 TF/s; H100's efficient forward fraction 0.20 x 4096/(4096+256)
    # x (128/128)^0.3 x sustained 0.82 = 0.15435: 1.0995e12 / (164.9e12 x 0.15435) = 43.2 ms
    flops = 2 * 8 * 16 * 4096 * 4096 * 256
    assert flops == 1_099_511_627_776
    frac = eff["attention"]["efficient"][0] * 4096 / (4096 + eff["attention_seq_half"]) * eff["sustained_fraction"]
    assert got == pytest.approx(flops / (gpu.peak_flops["tf32"] / 3 * frac), rel=1e-12)
    assert got == pytest.approx(0.0432, rel=2e-3)
    # the flash price it replaced: the fp32 peak at flash's fraction, another number
    flash = st.attention_seconds(8, 16, 4096, 4096, 128, 128, False, False, "fp32", gpu, kernel="flash")
    assert abs(flash - got) > 0.1 * got


def test_fp32_math_path_priced_as_its_bmms():
    gpu = get_gpu("h100")
    eff = st.efficiency(gpu)
    b, h, s, d = 2, 4, 1024, 66                     # head dim 66: no fused kernel takes it in fp32
    got = st.attention_seconds(b, h, s, s, d, d, True, False, "fp32", gpu)
    # Q K^T and P V at the matmul model, then the softmax over the 4 B x 8 x 1024 x 1024 scores
    # (read S, write P: 67 MB); causal runs every pair on this path
    parts = (st.matmul_seconds(s, s, d, b * h, "fp32", gpu, eff) + st.matmul_seconds(s, d, s, b * h, "fp32", gpu, eff)
             + st.memory_seconds(4 * b * h * s * s * 2, gpu, eff))
    assert got == pytest.approx(parts, rel=1e-12)


def test_fp32_step_claims_and_prices_memory_efficient(models):
    rec = _audit(models, "unet")
    gpu = get_gpu("h100")
    p = predict_step_time(rec, gpu, {})
    line = next(a for a in p["assumptions"] if "attention as" in a)
    assert line.startswith("fp32 attention as memory-efficient on H100 SXM (SDPA's choice for fp32 inputs, "
                           "flash and cuDNN taking 16-bit only"), line
    assert "16-bit inputs there" not in line
    assert attention_kernels(rec.ops, gpu, st.efficiency(gpu)) == {"fp32": "efficient"}
    # the attention time is the memory-efficient kernel's, call by call
    eff = st.efficiency(gpu)
    want = 0.0
    for row in rec.ops:
        for s in row.get("shapes") or ():
            if "attn" in s:
                back = "backward" in row["op"]
                want += s["count"] * st.attention_seconds(*s["attn"], False, back, "fp32", gpu, kernel="efficient",
                                                          eff=eff)
    assert want > 0
    assert p["by_kind"]["attention"] + _attention_launch(rec, gpu, eff) == pytest.approx(want, rel=1e-9)


def _attention_launch(rec, gpu, eff):
    """The launch-floor part of the attention rows (booked under launch overhead, not attention)."""
    from torchledger.steptime.predict import op_seconds
    return sum(op_seconds(r, gpu, eff)["launch"] for r in rec.ops if r.get("kind") == "attention")


def test_traced_math_path_is_priced_and_named_as_math(models):
    rec = _audit(models, "unet3d")
    assert rec.meta["attention_kernels"] == ["SDPA math path (bmm + softmax)"]
    gpu = get_gpu("h100")
    assert attention_kernels(rec.ops, gpu, st.efficiency(gpu)) == {"fp32": "math"}
    line = next(a for a in predict_step_time(rec, gpu, {})["assumptions"] if "attention as" in a)
    assert line.startswith("fp32 attention as the math path on H100 SXM (as the traced device ran it"), line


def test_bf16_step_keeps_flash():
    gpu = get_gpu("h100")
    ops = [{"kind": "attention", "op": "aten._scaled_dot_product_flash_attention.default", "count": 1,
            "shapes": [{"attn": [1, 1, 64, 64, 64, 64], "dtype": "bf16", "count": 1, "flops": 1}]}]
    assert attention_kernels(ops, gpu, st.efficiency(gpu)) == {"bf16": "flash"}
    from torchledger.steptime.predict import attention_assumption
    assert attention_assumption(ops, gpu, st.efficiency(gpu), "bf16") == (
        "bf16 attention as flash on H100 SXM (SDPA's choice for 16-bit inputs there), whatever kernel the "
        "traced device ran")


def test_a_part_may_name_its_own_fp32_kernel():
    # benchmarks/predict_cpu.py prices a host CPU, whose flash kernel takes fp32
    from torchledger.formulas.hardware import GPUSpec
    from torchledger.formulas.hardware_fields import HardwareFieldError, check_row
    from torchledger.steptime.predict import attention_assumption
    part = GPUSpec("host CPU", 0, 1e11, {"fp32": 1e12}, (), 8, None, None, 1, 1,
                   {"attention_kernel_fp32": "flash"}, {})
    eff = st.efficiency(part)
    assert st.sdpa_kernel("fp32", part, eff, d=66) == "flash"
    ops = [{"kind": "attention", "op": "x", "count": 1,
            "shapes": [{"attn": [1, 1, 64, 64, 64, 64], "dtype": "fp32", "count": 1, "flops": 1}]}]
    assert attention_assumption(ops, part, eff) == (
        "fp32 attention as flash on host CPU (the part's own fp32 kernel, its attention_kernel_fp32), "
        "whatever kernel the traced device ran")
    with pytest.raises(HardwareFieldError, match="attention_kernel_fp32"):
        check_row("p", {"efficiency": {"attention_kernel_fp32": "flush"}})
