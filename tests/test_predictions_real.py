"""Predictions that describe the model in front of them: frozen weights (fine-tuning), and the
sign of every reported gap. Real models, hand-counted figures (FLOP = 2 x multiply-add).
"""
from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import torchledger
from torchledger.analyzers.compare import check_comparisons, comparisons, predictions
from torchledger.cli import cli


def _mlp_frozen_first():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    model[0].weight.requires_grad_(False)
    return model


def test_frozen_first_layer_hand_count():
    """x [4, 8] (no grad) -> Linear(8, 16) frozen -> ReLU -> Linear(16, 4) trainable.
    layer 1: forward 2*4*8*16 = 1,024; backward 0 (its weight is frozen and x needs no grad)
    layer 2: forward 2*4*16*4 = 512;   backward 512 (its weight grad; its input h needs none)
    measured = 1,024 + 512 + 512 = 2,048 = the prediction; 6ND = 6*(128+64)*4 = 4,608."""
    model = _mlp_frozen_first()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with torchledger.trace(model, optimizer=opt, tokens=4) as t:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    tot, p = t.record.totals, t.record.predictions
    assert tot["flops"]["forward"] == 1_024 + 512
    assert tot["flops"]["backward"] == 512
    assert tot["param_matmul_flops_forward"] == 1_536
    assert tot["param_matmul_flops_grad"] == 512                 # 0 + 512 * 1 gradient
    assert p["flops_per_weight_grads"] == tot["flops"]["total"] == 2_048
    assert p["flops_6nd"] == 4_608
    (row,) = [r for r in comparisons(t.record) if r["quantity"].startswith("training FLOPs")]
    assert row["quantity"] == "training FLOPs vs weights' fwd + grads" and row["ratio"] == 1.0
    assert "128 of 192 params are frozen" in row["explanation"]
    # static bytes, AdamW fp32: 64 trainable x 16 + 128 frozen x 4 (weights only) = 1,536
    assert p["static_bytes"] == 64 * 16 + 128 * 4 == 1_536


def test_trainable_mlp_keeps_6nd():
    """Nothing frozen: the weights' term stays 6ND (the frozen-aware figure is kept beside it)."""
    model = _mlp_frozen_first()
    model[0].weight.requires_grad_(True)
    with torchledger.trace(model, tokens=4) as t:
        model(torch.randn(4, 8)).sum().backward()
    # gradients: layer 1's weight 1,024 (x needs none) + layer 2's weight and input 2 * 512
    assert t.record.totals["param_matmul_flops_grad"] == 1_024 + 2 * 512
    assert t.record.predictions["flops_per_weight_grads"] == 1_536 + 2_048 == t.record.totals["flops"]["total"]
    assert [r["quantity"] for r in comparisons(t.record)][0] == "training FLOPs vs 6ND"


def test_no_grad_forward_makes_no_gradient_matmuls():
    model = _mlp_frozen_first()
    with torchledger.trace(model, tokens=4) as t:
        with torch.no_grad():
            model(torch.randn(4, 8))
    assert t.record.totals["param_matmul_flops_forward"] == 1_536
    assert t.record.totals["param_matmul_flops_grad"] == 0


LORA = textwrap.dedent('''
    import torch, torch.nn as nn, torchledger
    import transformers as tf

    class LoRA(nn.Module):
        """A frozen Linear plus a trainable low-rank update B(A(x)), rank r."""
        def __init__(self, base, r=4):
            super().__init__()
            self.base = base
            self.A = nn.Linear(base.in_features, r, bias=False)
            self.B = nn.Linear(r, base.out_features, bias=False)
            nn.init.zeros_(self.B.weight)

        def forward(self, x):
            return self.base(x) + self.B(self.A(x))

    def audit_spec():
        cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
        model = tf.LlamaForCausalLM(cfg)
        model.requires_grad_(False)                       # the base model is frozen
        for layer in model.model.layers:
            layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
        ids = torch.randint(0, 256, (2, 32))
        return torchledger.AuditSpec(model, {"input_ids": ids, "labels": ids},
            optimizer=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-3))
''')


@pytest.fixture(scope="module")
def lora_record(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("lora") / "lora.py"
    path.write_text(LORA)
    out = path.with_suffix(".json")
    res = CliRunner().invoke(cli, ["audit", str(path), "--steps", "1", "--fail-on", "warning",
                                   "--format", "json", "--output", str(out)])
    return res, json.loads(out.read_text())


def test_lora_fine_tune_audit_passes(lora_record):
    res, d = lora_record
    assert res.exit_code == 0, res.output
    rules = [f["rule"] for f in d["findings"]]
    assert "TL-CMP-001" not in rules and "TL-CMP-002" not in rules


def test_lora_fine_tune_predictions(lora_record):
    """Tiny Llama, V=256, d=64, L=2, d_ff=128, 4 heads, B=2 x T=32 (D=64 rows), base frozen,
    rank-4 adapters on q and v. Per layer the frozen weights are q, k, v, o (4096 each) and
    gate, up, down (8192 each); the adapters A (64x4) and B (4x64), 256 each.
    Layer 0 reads the frozen embedding (no grad): q, k, v and the A's see an input that needs
    no grad; everything after q and v does (the adapters train). Per weight x D rows:
      layer 0: q, k, v frozen, input no grad: 2 each    -> 2 * 3*4096 = 24,576
               A_q, A_v trainable, input no grad: 4     -> 4 * 2*256 = 2,048
               B_q, B_v trainable, input needs grad: 6  -> 6 * 2*256 = 3,072
               o, gate, up, down frozen, input grad: 4  -> 4 * (4096 + 3*8192) = 114,688
      layer 1: q, k, v, o, gate, up, down frozen: 4     -> 4 * (4*4096 + 3*8192) = 163,840
               A's and B's trainable, input grad: 6     -> 6 * 4*256 = 6,144
      lm_head (256 x 64) frozen, input grad: 4          -> 4 * 16,384 = 65,536
    sum 379,904 x 64 rows = 24,313,856; attention 12*L*T*d*D = 12*2*32*64*64 = 3,145,728;
    total 27,459,584 = the measured FLOPs exactly (6ND would say 38,535,168: -28.7%)."""
    _, d = lora_record
    p, tot = d["predictions"], d["totals"]
    assert tot["trainable_params"] == 2 * 4 * 256                      # 2,048
    assert p["flops_per_weight_grads"] == 379_904 * 64 == 24_313_856
    assert p["flops_6nd_attention"] == 24_313_856 + 3_145_728 == tot["flops"]["total"]
    assert p["flops_6nd"] == 38_535_168
    # static: 2,048 x 16 (AdamW fp32) + 115,008 frozen x 4 = 32,768 + 460,032 = 492,800
    assert p["static_bytes"] == 492_800


def _gpt2_tiny_record():
    from torchledger.models import build_model, example_inputs
    torch.manual_seed(0)
    model = build_model("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters())
    batch = example_inputs("gpt2-tiny", batch=2, seq_len=16)
    with torchledger.trace(model, optimizer=opt, tokens=32, seq_len=16) as t:
        model(**batch).backward()
        opt.step()
        opt.zero_grad()
    return t.record


@pytest.mark.parametrize("scale", [1.5, 0.5])
def test_gap_wording_follows_measured_minus_predicted(scale):
    """Measured above the prediction reads "above", below reads "below", with the share of
    the prediction: 1.5x -> 50.0% above, 0.5x -> 50.0% below."""
    rec = _gpt2_tiny_record()
    assert not check_comparisons([rec])
    p = predictions(rec)
    rec.totals["flops"]["total"] = int(p["flops_6nd_attention"] * scale)
    rec.totals["optimizer_state_bytes"] += int((scale - 1) * p["static_bytes"])
    msgs = {f.rule: f.message for f in check_comparisons([rec])}
    word = "above" if scale > 1 else "below"
    assert re.search(rf"are 50\.0% {word} 6ND \+ 12LTd attention", msgs["TL-CMP-001"])
    assert f"{scale:.3f}x, 50.0% {word}" in msgs["TL-CMP-002"]
