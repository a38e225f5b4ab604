"""Encoder-decoder predictions (T5, BART) and the Korthikanti attention term.

Hugging Face models built from tiny configs (no download), audited on fake tensors through
``run_audit``. Shared sizes: V=256, d=64, 4 heads of 16 (d_attn 64), d_ff 256 = 4d,
2 encoder + 3 decoder layers (unequal, so a mix-up of the two counts shows), B=2, encoder
T_enc=32 (D_enc = 64 tokens); decoder T_dec = 32 or 16.

Hand arithmetic (ACCOUNTING.md sections 3, 6, 7; d^2 = 4,096):
  matmul weights: encoder layer q/k/v/o 4d^2 + MLP 2*d*4d = 12d^2 = 49,152; decoder layer
  self 4d^2 + cross 4d^2 + MLP 8d^2 = 16d^2 = 65,536; tied LM head V*d = 16,384
  N = 2*49,152 + 3*65,536 + 16,384 = 311,296 = 12*2*d^2 + 16*3*d^2 + V*d (params_12ld2)
  attention, training, dense: 12*d_attn*(L_enc*T_enc*D_enc + L_dec*T_dec*D_dec
  + L_dec*T_enc*D_dec) (encoder self, decoder self, cross: queries are decoder tokens,
  keys the encoder's T_enc positions)
"""
from __future__ import annotations

import textwrap

import pytest

from torchledger.formulas.activations import (korthikanti_cross_attention_bytes,
                                               korthikanti_layer_bytes)
from torchledger.analyzers.compare import (_attention_storage, check_comparisons, comparisons,
                                           predictions)
from torchledger.formulas.flops import encoder_decoder_attention_flops
from torchledger.formulas.params import params_12ld2_encoder_decoder
from torchledger.record import StepRecord

transformers = pytest.importorskip("transformers")

N = 311_296
D_ENC = 64

HEADER = """\
import torch, torchledger
import transformers as tf
V, B, T = 256, 2, 32
def t5():
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=256,
        num_layers=2, num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
        use_cache=False))
def bart_config():
    return tf.BartConfig(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_position_embeddings=64, use_cache=False,
        attn_implementation="sdpa")
def bart():
    return tf.BartForConditionalGeneration(bart_config())
def spec(model, t_dec):
    ids = torch.randint(0, V, (B, T))
    labels = ids if t_dec == T else torch.randint(0, V, (B, t_dec))
    return torchledger.AuditSpec(model, {"input_ids": ids, "labels": labels})
"""

SPECS = {
    "t5": "return spec(t5(), 32)",
    "t5_dec16": "return spec(t5(), 16)",
    "bart": "return spec(bart(), 32)",
    "bart_dec16": "return spec(bart(), 16)",
    # no LM head: the decoder length cannot be read off the record; BartModel shifts
    # input_ids into decoder_input_ids, so T_dec = T_enc holds here
    "bart_model": """ids = torch.randint(0, V, (B, T))
    return torchledger.AuditSpec(tf.BartModel(bart_config()), {"input_ids": ids},
                                 loss_fn=lambda o, i: o.last_hidden_state.float().mean())""",
}

_CACHE: dict = {}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    from torchledger.audit.engine import run_audit

    def get(name):
        if name not in _CACHE:
            path = tmp_path_factory.mktemp("encdec") / f"{name}.py"
            path.write_text(HEADER + "def audit_spec():\n    " + textwrap.dedent(SPECS[name]) + "\n")
            _CACHE[name] = run_audit(str(path), device="fake", steps=1).record
        return _CACHE[name]
    return get


def rows(rec):
    return {r["quantity"]: r for r in comparisons(rec)}


# --- closed forms -----------------------------------------------------------------------------

def test_closed_forms_by_hand():
    # t5-small: (12*6 + 16*6) * 512^2 + 32128*512 = 44,040,192 + 16,449,536
    assert params_12ld2_encoder_decoder(512, 6, 6, 32128) == 60_489_728
    # t5-small, B=2, T=128: 18 attention calls (6 encoder self, 6 decoder self, 6 cross),
    # each 12 * 128 * 512 * 256 = 201,326,592
    assert encoder_decoder_attention_flops(6, 6, 128, 128, 512, 256, 256) == 18 * 201_326_592
    # causal halves the decoder self-attention only: 12 calls full + 6 halved
    assert encoder_decoder_attention_flops(6, 6, 128, 128, 512, 256, 256, causal=True) == 15 * 201_326_592
    # s_d = 2, s_e = 3, b = 1, h = 4, a = 2: (9*2 + 4*3)*4 = 120, + 5*2*2*3 = 60
    assert korthikanti_cross_attention_bytes(2, 3, 1, 4, 2) == 180
    assert korthikanti_cross_attention_bytes(2, 3, 1, 4, 2, fused_attention=True) == 120


# --- T5 and BART, equal lengths: 6ND + attention is the measured total exactly ------------------

@pytest.mark.parametrize("name", ["t5", "bart"])
def test_equal_lengths_exact(record, name):
    rec = record(name)
    t, p = rec.totals, predictions(rec)
    cfg = rec.meta["config"]
    assert (cfg["encoder_decoder"], cfg["n_encoder_layers"], cfg["n_decoder_layers"]) == (True, 2, 3)
    assert t["matmul_params"] == N and t["tokens"] == D_ENC
    assert p["params_12ld2"] == 12 * 2 * 4096 + 16 * 3 * 4096 + 256 * 64 == N
    # attention: 12*64*(2*32*64 + 3*32*64 + 3*32*64) = 768 * 16,384 = 12,582,912
    attn = 12 * 64 * (2 * 32 * 64 + 3 * 32 * 64 + 3 * 32 * 64)
    assert attn == 12_582_912 == t["attention_flops"]["dense"]
    # 6ND + attention = 6 * 311,296 * 64 + 12,582,912 = 119,537,664 + 12,582,912
    assert p["flops_6nd_attention"] == 6 * N * D_ENC + attn == 132_120_576 == t["flops"]["total"]
    # causal: the decoder self-attention (3 * 32 * 64 of the 16,384) halved
    assert p["flops_6nd_attention_causal"] == 6 * N * D_ENC + attn - 12 * 64 * 3 * 32 * 64 // 2
    text = rows(rec)["training FLOPs vs 6ND + 12LTd"]["explanation"]
    assert "L = 2 encoder + 3 decoder layers" in text and "T_dec = 32 read off the LM head" in text
    assert "cross-attention counted" in rows(rec)["parameters (12*L*d^2 + V*d)"]["explanation"]


def test_t5_params_row(record):
    # T5 params: N plus RMSNorm weights (encoder 2 per layer * 2 + final 1, decoder 3 per layer
    # * 3 + final 1 = 15 of 64 = 960) plus the relative-position tables (32 buckets x 4 heads in
    # each stack's first layer = 256)
    rec = record("t5")
    assert rec.totals["params"] == N + 15 * 64 + 2 * 128 == 312_512


# --- unequal lengths: T_dec read off the LM head ------------------------------------------------

@pytest.mark.parametrize("name", ["t5_dec16", "bart_dec16"])
def test_decoder_length_from_lm_head(record, name):
    rec = record(name)
    t, p = rec.totals, predictions(rec)
    # encoder self 2*32*64 + decoder self 3*16*32 + cross 3*32*32 = 4,096 + 1,536 + 3,072
    attn = 12 * 64 * (2 * 32 * 64 + 3 * 16 * 32 + 3 * 32 * 32)
    assert attn == 6_684_672 == t["attention_flops"]["dense"]
    # weights at their own rows: encoder 98,304 x 64 + decoder (self, cross q/o, MLP) 3*57,344
    # x 32 + cross K/V 3*8,192 x 64 + head 16,384 x 32 = 13,893,632; x 6 = 83,361,792
    per_weight = 6 * (98_304 * 64 + 3 * 57_344 * 32 + 3 * 8_192 * 64 + 16_384 * 32)
    assert p["flops_6nd_per_weight"] == per_weight == 83_361_792
    assert p["flops_6nd_attention"] == per_weight + attn == 90_046_464 == t["flops"]["total"]
    text = rows(rec)["training FLOPs vs 6ND + 12LTd"]["explanation"]
    assert "T_dec = 16 read off the LM head" in text and "not 6ND" in text
    assert check_comparisons([rec]) == []


def test_no_lm_head_assumes_equal_lengths(record):
    rec = record("bart_model")
    t, p = rec.totals, predictions(rec)
    # BartModel: no head; N = 2*49,152 + 3*65,536 = 294,912; attention as above 12,582,912
    assert t["matmul_params"] == 294_912
    assert p["flops_6nd_attention"] == 6 * 294_912 * D_ENC + 12_582_912 == t["flops"]["total"]
    assert "T_dec = 32 read off the decoder's first projection" in rows(rec)["training FLOPs vs 6ND + 12LTd"]["explanation"]


def test_korthikanti_encoder_decoder(record):
    rec = record("t5_dec16")                 # SDPA math path: the s^2 terms stay
    assert rec.meta["attention_kernels"] == ["SDPA math path (bmm + softmax)"]
    b, h, a = 2, 64, 4
    # encoder layer at s=32: 34*32*2*64 + 5*4*32*32*2 = 139,264 + 40,960 = 180,224
    enc = korthikanti_layer_bytes(32, b, h, a)
    assert enc == 180_224
    # decoder layer at s=16: 34*16*2*64 + 5*4*16*16*2 = 69,632 + 10,240 = 79,872; its cross
    # block (9*16 + 4*32)*2*64 + 5*4*16*32*2 = 34,816 + 20,480 = 55,296
    dec = korthikanti_layer_bytes(16, b, h, a) + korthikanti_cross_attention_bytes(16, 32, b, h, a)
    assert dec == 79_872 + 55_296
    assert predictions(rec)["activation_bytes_korthikanti_16bit"] == 2 * enc + 3 * dec == 765_952
    text = rows(rec)["activation bytes vs Korthikanti (16-bit)"]["explanation"]
    assert "2 encoder layers at s = 32 + 3 decoder layers at s = 16" in text
    assert "materialised attention matrix" in text


# --- the shape reader --------------------------------------------------------------------------

def test_shape_reader_needs_both_stacks():
    import transformers as tf
    from torchledger.tracer.shape import model_config
    t5 = tf.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                     num_decoder_layers=3, num_heads=4)
    assert model_config(tf.T5ForConditionalGeneration(t5))["n_layers"] == 5
    enc = model_config(tf.T5EncoderModel(t5))
    assert "encoder_decoder" not in enc and enc["n_layers"] == 2
    bert = model_config(tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)))
    assert "encoder_decoder" not in bert and bert["n_layers"] == 2   # cls.predictions.decoder


# --- Korthikanti: the s^2 term is dropped for fused kernels only -------------------------------

def _gpt2_record(kernels):
    """HF GPT-2 small, B=2, T=128, with the attention kernels the trace saw."""
    rec = StepRecord()
    rec.meta = {"attention_kernels": kernels, "seq_len": 128, "dtype": "torch.float32",
                "config": {"kind": "transformer", "source": "huggingface:gpt2", "vocab_size": 50257,
                           "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12,
                           "d_ff": 3072, "mlp": "gelu", "norm": "layernorm", "bias": True,
                           "tie_embeddings": True, "n_positions": 1024, "d_attn": 768}}
    rec.totals.update(tokens=256, matmul_params=123_532_032)
    return rec


@pytest.mark.parametrize("kernels, fused", [
    (["SDPA math path (bmm + softmax)"], False),
    (["CPU flash attention"], True),
    (["CUDA flash attention"], True),
    (["memory-efficient attention"], True),
    (["cuDNN attention"], True),
    (["_scaled_dot_product_fused_attention_overrideable"], True),
    (["CUDA flash attention", "SDPA math path (bmm + softmax)"], False),   # some layers on math
    (["_scaled_dot_product_attention_math"], False),
    (None, False),                                                       # eager attention
])
def test_korthikanti_gpt2(kernels, fused):
    # s=128, b=2, h=768, a=12, L=12: s*b*h = 196,608; 34*196,608 = 6,684,672 per layer;
    # the score term 5*a*s/h = 5*12*128/768 = 10 -> 10*196,608 = 1,966,080 per layer
    rec = _gpt2_record(kernels)
    got = predictions(rec)["activation_bytes_korthikanti_16bit"]
    assert got == (12 * 6_684_672 if fused else 12 * (6_684_672 + 1_966_080))
    assert got == (80_216_064 if fused else 103_809_024)
    assert _attention_storage(rec)[0] is fused
    text = rows(rec)["activation bytes vs Korthikanti (16-bit)"]["explanation"]
    assert ("5as^2b term dropped" in text) is fused and ("5as^2b term kept" in text) is not fused


def test_every_build_kernel_label_is_classified():
    """Every name tracer/build.py gives a kernel: only the math path keeps the scores."""
    from torchledger.tracer.build import ATTENTION_KERNELS
    for raw, label in ATTENTION_KERNELS.items():
        rec = StepRecord()
        rec.meta = {"attention_kernels": [label]}
        assert _attention_storage(rec)[0] is (raw != "math"), label


def test_korthikanti_note_names_what_of_gpts_layer_the_block_does_otherwise():
    """The activation row's ratio is the tracer's and the architecture's: its note says which
    of Korthikanti's GPT layer (4d GELU MLP, full K/V heads, LayerNorm) this block changes."""
    gpt = rows(_gpt2_record(["CPU flash attention"]))["activation bytes vs Korthikanti (16-bit)"]
    assert "Korthikanti's layer is GPT's" not in gpt["explanation"]
    rec = _gpt2_record(["CPU flash attention"])
    rec.meta["config"].update(mlp="swiglu", d_ff=2048, n_kv_heads=4, norm="rmsnorm")
    text = rows(rec)["activation bytes vs Korthikanti (16-bit)"]["explanation"]
    # d_ff = 2048 / 768 = 2.67d; 4 of 12 K/V heads
    assert ("Korthikanti's layer is GPT's: its MLP is GELU's at 4d (this one: swiglu, d_ff = 2.67d), "
            "its K/V heads are all 12 (this one: 4), its norms LayerNorms (this one: rmsnorm); ") in text
