"""What a new user meets on models nobody here wrote (issue 20, items 1, 3 and 4).

* Deep-copied layers (``nn.TransformerEncoder``/``Decoder``, ``clones()`` helpers) keep their
  weights on fake tensors: fake and cpu agree on N and on every other count.
* accelerate's autocast (``Trainer(bf16=True)`` wraps ``model.forward`` in it) is the step's.
* ``nn.Transformer`` is an encoder-decoder (both stacks in the params row and the attention
  term); a list of detection images counts samples; image models show no 6ND; a mixture of
  experts' params row names the experts first.

Every audit here runs one step of a tiny model (run_audit, timing steps off).
"""
from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from torch import nn

import torchledger
from torchledger.analyzers.compare import comparisons, predictions
from torchledger.audit.engine import run_audit
from torchledger.record import counts_samples
from torchledger.render.table import render_table
from torchledger.audit.spec import infer_tokens

HEADER = """\
import copy, torch, torchledger
from torch import nn
import torch.nn.functional as F

class Clones(nn.Module):
    # three deep copies of one Linear(64, 64) and a head Linear(64, 10)
    def __init__(self):
        super().__init__()
        layer = nn.Linear(64, 64)
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(3)])
        self.head = nn.Linear(64, 10)
    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 128, dropout=0.0,
                                                                    batch_first=True), 2)
        self.head = nn.Linear(32, 64)
    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)))

class Seq2Seq(nn.Module):
    # nn.Transformer, d=32, 4 heads, 2 encoder + 3 decoder layers, d_ff 128, V=64, untied head
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.tr = nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=3,
                                 dim_feedforward=128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 64)
    def forward(self, src, tgt):
        return self.head(self.tr(self.emb(src), self.emb(tgt)))

class Detector(nn.Module):
    # torchvision detection's call: model(list of [3, H, W] images, list of targets)
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.cls = nn.Linear(8, 5)
    def forward(self, images, targets):
        loss = 0
        for img, t in zip(images, targets):
            f = self.backbone(img[None]).mean((2, 3))
            loss = loss + F.cross_entropy(self.cls(f).expand(len(t["labels"]), -1), t["labels"])
        return {"loss_classifier": loss}

class PixelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)
    def forward(self, x):
        return self.fc(x.flatten(1))

def clones():
    return torchledger.AuditSpec(Clones(), torch.randn(8, 64))

def encoder():
    return torchledger.AuditSpec(Encoder(), torch.randint(0, 64, (2, 8)))

def seq2seq():
    return torchledger.AuditSpec(Seq2Seq(), (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 4))))

def bare():
    m = nn.Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=128,
                       dropout=0.0, batch_first=True)
    return torchledger.AuditSpec(m, (torch.randn(2, 8, 32), torch.randn(2, 4, 32)), seq_len=8)

def detector():
    images = [torch.randn(3, 24, 32), torch.randn(3, 16, 20)]
    targets = [{"boxes": torch.rand(2, 4), "labels": torch.randint(0, 5, (2,))} for _ in images]
    return torchledger.AuditSpec(Detector(), (images, targets), loss_fn=lambda o, i: sum(o.values()))

def pixel_mlp():
    return torchledger.AuditSpec(PixelMLP(), torch.randn(4, 3, 8, 8))
"""

_CACHE: dict = {}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("new_users") / "models.py"
    path.write_text(HEADER)

    def get(entry, device="fake"):
        if (entry, device) not in _CACHE:
            _CACHE[entry, device] = run_audit(str(path), entry=entry, device=device, steps=1,
                                              timing_steps=0).record
        return _CACHE[entry, device]
    return get


def rows(rec):
    return {r["quantity"]: r for r in comparisons(rec)}


# --- item 1: deep-copied layers keep their weights on fake tensors ------------------------------

SAME = ("params", "matmul_params", "flops", "activation_bytes", "param_bytes", "grad_bytes",
        "optimizer_state_bytes", "param_matmul_flops_forward", "tokens")


@pytest.mark.parametrize("entry", ["clones", "encoder", "seq2seq"])
def test_fake_and_cpu_agree(record, entry):
    fake, cpu = record(entry).totals, record(entry, "cpu").totals
    for key in SAME:
        assert fake[key] == cpu[key], key
    assert not [w for w in record(entry).warnings if "FakeTensorMode" in w]


def test_clones_n_by_hand(record):
    # three deep-copied Linear(64, 64) and a head Linear(64, 10): 3*4,096 + 640 = 12,928
    # (on fake, before the fix, only the head's 640 was left)
    t = record("clones").totals
    assert t["matmul_params"] == 3 * 64 * 64 + 64 * 10 == 12_928
    assert predictions(record("clones"))["flops_6nd"] == 6 * 12_928 * 8


def test_deepcopy_under_audit_mode_keeps_the_mode():
    import warnings
    from torchledger.tracer.fake import fake_mode
    with warnings.catch_warnings(record=True) as caught, fake_mode() as mode:
        warnings.simplefilter("always")
        layer = nn.Linear(4, 4)
        twin = copy.deepcopy(layer)
    # torch's own deepcopy asks a fake tensor for its data pointer and warns "almost
    # definitely a bug in your code": not the user's, not shown
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]
    assert twin.weight.fake_mode is mode is layer.weight.fake_mode
    assert twin.weight.untyped_storage()._cdata != layer.weight.untyped_storage()._cdata
    assert twin.weight.requires_grad


def test_a_copied_mode_is_named_in_the_warnings():
    # the user's own FakeTensorMode: torch deep-copies it with every fake tensor (a plain
    # mode then refuses the mix; one that allows non-fake inputs converts them at every op);
    # the tracer cannot count those weights and says so instead of reporting a wrong N silently
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = nn.Linear(8, 8)
        model = nn.Sequential(layer, copy.deepcopy(layer), copy.deepcopy(layer))
        x = torch.randn(2, 8)
        with torchledger.trace(model) as t:
            model(x).sum().backward()
    said = [w for w in t.record.warnings if "another FakeTensorMode" in w]
    assert len(said) == 1 and said[0].startswith("4 of 6 parameters"), t.record.warnings


# --- item 3: autocast entered inside forward (accelerate, Trainer(bf16=True)) -------------------

def test_accelerate_bf16_autocast_is_seen():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    model, opt = acc.prepare(model, opt)     # model.forward now enters autocast itself
    x = torch.randn(8, 16)
    with torchledger.trace(model, opt, tokens=8) as t:
        out = model(x)
        acc.backward(out.float().mean())
        opt.step()
        opt.zero_grad()
    assert out.dtype == torch.float32       # accelerate casts the output back: only the probe knows
    assert t.record.meta["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    report = t.report()
    assert "(float32 weights, bfloat16 compute under autocast)" in report.splitlines()[0]
    assert "autocast: the step computes in bfloat16 (cpu autocast)" in report


def test_no_autocast_no_note():
    model = nn.Linear(4, 4)
    with torchledger.trace(model) as t:
        model(torch.randn(2, 4)).sum().backward()
    assert "autocast" not in t.record.meta


# --- item 4: nn.Transformer is an encoder-decoder ----------------------------------------------
# d=32, V=64, 2 encoder + 3 decoder layers, B=2, T_enc=8 (D_enc=16), T_dec=4 (D_dec=8).
# Weights: encoder layer 12d^2 = 12,288, decoder layer 16d^2 = 16,384, head V*d = 2,048:
# N = 2*12,288 + 3*16,384 + 2,048 = 75,776 = 12*L_enc*d^2 + 16*L_dec*d^2 + V*d.
# Forward matmuls: encoder 2 x 12,288 x 16 rows x 2 = 786,432; decoder per layer (8 rows,
# cross K/V at the encoder's 16) 2*(8*3,072 + 8*1,024 + 8*1,024 + 16*2,048 + 8*1,024 +
# 8*8,192) = 294,912, x 3 = 884,736; head 2*8*2,048 = 32,768.
# Attention (dense, training = 3 x forward): 12*d*(L_enc*T_enc*D_enc + L_dec*T_dec*D_dec +
# L_dec*T_enc*D_dec) = 384*(256 + 96 + 192) = 208,896.
# Everything needs its gradients (the embeddings train): total = 3 x forward
# = 3*(786,432 + 884,736 + 32,768) + 208,896 = 5,320,704.
N_S2S = 75_776
ATTN_S2S = 208_896
TOTAL_S2S = 5_320_704


def test_nn_transformer_is_encoder_decoder(record):
    rec = record("seq2seq")
    t, p, cfg = rec.totals, predictions(rec), rec.meta["config"]
    assert (cfg["encoder_decoder"], cfg["n_encoder_layers"], cfg["n_decoder_layers"]) == (True, 2, 3)
    assert t["matmul_params"] == N_S2S
    assert p["params_12ld2"] == 12 * 2 * 32**2 + 16 * 3 * 32**2 + 64 * 32 == N_S2S
    assert t["attention_flops"]["dense"] == ATTN_S2S
    assert t["flops"]["total"] == TOTAL_S2S == p["flops_6nd_attention"]
    r = rows(rec)
    assert "L = 2 encoder + 3 decoder layers" in r["parameters (12*L*d^2 + V*d)"]["explanation"]
    text = r["training FLOPs vs 6ND + 12LTd"]["explanation"]
    assert "L = 2 encoder + 3 decoder layers" in text and "T_dec = 4 read off the decoder" in text


def test_nn_transformer_no_flops_finding(record):
    from torchledger.analyzers.compare import check_comparisons
    assert check_comparisons([record("seq2seq")]) == []       # was TL-CMP-001 "1348.8% above"


def test_unet_is_no_encoder_decoder_transformer():
    # a U-Net's `encoder` and `decoder` lists of conv blocks, attention in the middle: no
    # token embedding, no attention in the stacks' layers, so no transformer config
    from torchledger.tracer.shape import model_config

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()) for _ in range(2)])
            self.mid = nn.MultiheadAttention(4, 1)
            self.decoder = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()) for _ in range(2)])
    assert model_config(UNet()) is None
    bare = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=32)
    cfg = model_config(bare)
    assert (cfg["d_model"], cfg["n_encoder_layers"], cfg["n_decoder_layers"]) == (16, 1, 2)


def test_bare_nn_transformer(record):
    # no embedding, no head: V = 0, d from the attention; N = 2*12,288 + 3*16,384 = 73,728
    rec = record("bare")
    t, p = rec.totals, predictions(rec)
    assert rec.meta["config"]["vocab_size"] == 0 and rec.meta["config"]["d_model"] == 32
    assert p["params_12ld2"] == t["matmul_params"] == 73_728
    # the vectors need no gradient: the first layers' input gradients are not made, so the
    # predicted term reads the weights' own gradients; the attention term is the same as above
    assert t["attention_flops"]["dense"] == ATTN_S2S
    assert p["flops_6nd_attention"] == t["flops"]["total"]


# --- item 4: detection images count samples; image models show no 6ND ----------------------------

def test_list_of_images_counts_samples():
    images = [torch.randn(3, 480, 640), torch.randn(3, 400, 600)]
    targets = [{"boxes": torch.rand(2, 4), "labels": torch.randint(0, 5, (2,))} for _ in images]
    count = infer_tokens((images, targets))
    assert count.tokens == 2 and count.seq_len is None
    assert counts_samples({"tokens_source": count.source})
    assert count.source.startswith("count of inputs[0], a list of 2 images [3, 480, 640]")
    # token ids still win; a tuple of two sequence batches is not a list of images
    assert infer_tokens({"input_ids": torch.ones(2, 8, dtype=torch.long), "images": images}).tokens == 16
    assert infer_tokens((torch.randn(3, 8, 32), torch.randn(3, 4, 32))).tokens == 24


@pytest.mark.parametrize("entry", ["detector", "pixel_mlp"])
def test_image_models_show_no_6nd(record, entry):
    rec = record(entry)
    assert counts_samples(rec.totals)
    table = render_table(rec)
    assert "6ND (N =" not in table and "6ND =" not in table
    names = [r["quantity"] for r in comparisons(rec)]
    assert "training FLOPs vs 6ND" not in names
    assert "training FLOPs vs 6 x sum(weight x rows)" in names


def test_detector_and_pixel_mlp_by_hand(record):
    det = record("detector").totals
    assert det["tokens"] == 2                       # the two images, not rows of the first
    # PixelMLP: Linear(192, 10) on 4 rows: forward 2*4*192*10 = 15,360, its weight gradient
    # 15,360, no input gradient (pixels): 30,720 = the reference row exactly
    rec = record("pixel_mlp")
    assert rec.totals["flops"]["total"] == 30_720
    row = rows(rec)["training FLOPs vs 6 x sum(weight x rows)"]
    assert row["predicted"] == 30_720 and "counts samples, not tokens" in row["explanation"]


# --- item 4: a mixture of experts' params row names the experts ----------------------------------

def test_moe_params_row_names_the_experts_first(tmp_path):
    tf = pytest.importorskip("transformers")
    path = tmp_path / "moe.py"
    path.write_text(textwrap.dedent("""\
        import torch, torchledger
        import transformers as tf
        def audit_spec():
            cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                attn_implementation="sdpa", use_cache=False)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)      # grouped_mm on fake tensors: bf16
            try:
                model = tf.MixtralForCausalLM(cfg)
            finally:
                torch.set_default_dtype(old)
            ids = torch.randint(0, 256, (2, 16))
            return torchledger.AuditSpec(model, {"input_ids": ids, "labels": ids})
        """))
    rec = run_audit(str(path), steps=1, timing_steps=0).record
    cfg = rec.meta["config"]
    # 4 experts x 2 layers x SwiGLU 3*64*128 = 196,608
    assert (cfg["n_experts"], cfg["moe_layers"], cfg["expert_params"]) == (4, 2, 196_608)
    row = rows(rec)["parameters (12*L*d^2 + V*d)"]
    # 12*2*64^2 + 256*64 = 114,688 predicted; the experts but one add 3/4 of 196,608 = 147,456,
    # more than the untied head (16,384), the SwiGLU shape or the K/V heads
    assert row["predicted"] == 114_688
    assert row["explanation"].startswith("main cause: 4 experts in each of 2 layers hold 196,608 params")
    assert "every expert but one adds 147,456" in row["explanation"]


def test_dense_params_row_unchanged(record):
    # a dense model's row names no experts
    rec = record("seq2seq")
    assert "experts" not in rows(rec)["parameters (12*L*d^2 + V*d)"]["explanation"]
