"""What a new user meets on diffusion, state-space, recommender and Hugging Face models
(issue 31, items 1 to 5), each on a tiny stand-in of the same structure:

* a Mamba-2-like SSM (selective scan written in torch) and transformers' Mamba2 from a config:
  no attention, so no 12LTd, 12Ld^2 or Korthikanti row and no false TL-CMP-001;
* D guessed from a tensor that is not a token-id sequence (a UNet's ``encoder_hidden_states``,
  a DLRM's sparse ids) counts samples and warns what to pass;
* ``trace()`` infers T from the token ids as ``audit`` does (a Gemma-like head_dim);
* ``--gpu`` predictions' header line; hints that know what is applied.

Every audit runs one step of a tiny model (run_audit, fake tensors, timing steps off).
"""
from __future__ import annotations

import pytest
import torch

import torchledger
from torchledger.analyzers.compare import comparisons, predictions
from torchledger.audit.engine import run_audit

MODELS = '''\
import torch, torchledger
from torch import nn
import torch.nn.functional as F

class SSMBlock(nn.Module):
    # a Mamba-2-like block: in_proj -> depthwise conv1d -> selective scan (written in torch) -> gate -> out_proj
    def __init__(self, d, num_heads=4, state=8, conv=True):
        super().__init__()
        self.num_heads, self.state, inner = num_heads, state, 2 * d
        self.norm = nn.RMSNorm(d)
        self.in_proj = nn.Linear(d, 2 * inner + 2 * state + num_heads, bias=False)
        self.conv1d = nn.Conv1d(inner, inner, 4, groups=inner, padding=3) if conv else None
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.out_proj = nn.Linear(inner, d, bias=False)
    def forward(self, x):
        B, T, d = x.shape
        inner = 2 * d
        z, u, Bm, Cm, dt = self.in_proj(self.norm(x)).split([inner, inner, self.state, self.state, self.num_heads], -1)
        if self.conv1d is not None:
            u = F.silu(self.conv1d(u.transpose(1, 2))[..., :T].transpose(1, 2))
        dt = F.softplus(dt)                                        # [B, T, H]
        a = torch.exp(-torch.exp(self.A_log) * dt)                 # [B, T, H]
        u = u.view(B, T, self.num_heads, -1)                       # [B, T, H, P]
        h = x.new_zeros(B, self.num_heads, u.shape[-1], self.state)
        ys = []
        for t in range(T):                                         # selective scan
            h = a[:, t, :, None, None] * h + (dt[:, t, :, None] * u[:, t])[..., None] * Bm[:, t, None, None, :]
            ys.append(torch.einsum("bhpn,bn->bhp", h, Cm[:, t]))
        y = torch.stack(ys, 1).reshape(B, T, inner)
        return x + self.out_proj(y * F.silu(z))

class TinySSM(nn.Module):
    def __init__(self, V=128, d=32, L=2, conv=True):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList([SSMBlock(d, conv=conv) for _ in range(L)])
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.lm_head(self.norm(x)).flatten(0, 1), labels.flatten())

def ssm():
    ids = torch.randint(0, 128, (2, 16))
    return torchledger.AuditSpec(TinySSM(), {"ids": ids, "labels": ids})

def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    cfg = Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                       expand=2, n_groups=1, state_size=16, chunk_size=8, use_cache=False)
    ids = torch.randint(0, 128, (2, 16))
    return torchledger.AuditSpec(Mamba2ForCausalLM(cfg), {"input_ids": ids, "labels": ids})

class DLRM(nn.Module):
    def __init__(self, tables=4, rows=100, d=16, dense=13):
        super().__init__()
        self.bot = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, d))
        self.embs = nn.ModuleList([nn.EmbeddingBag(rows, d, mode="sum") for _ in range(tables)])
        self.top = nn.Sequential(nn.Linear(d * (tables + 1), 32), nn.ReLU(), nn.Linear(32, 1))
    def forward(self, dense, sparse, label):
        x = [self.bot(dense)] + [e(sparse[i]) for i, e in enumerate(self.embs)]
        return F.binary_cross_entropy_with_logits(self.top(torch.cat(x, 1)).squeeze(1), label)

def dlrm():
    B = 8
    return torchledger.AuditSpec(DLRM(), {"dense": torch.randn(B, 13), "sparse": torch.randint(0, 100, (4, B, 5)),
                                          "label": torch.rand(B)})

def dlrm2d():
    B = 8
    return torchledger.AuditSpec(DLRM(), {"dense": torch.randn(B, 13), "sparse": [torch.randint(0, 100, (B, 5)) for _ in range(4)],
                                          "label": torch.rand(B)})

class CrossAttn(nn.Module):
    def __init__(self, c, ctx):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(c, c), nn.Linear(ctx, c), nn.Linear(ctx, c), nn.Linear(c, c)
    def forward(self, x, ctx):
        B, C, H, W = x.shape
        h = x.flatten(2).transpose(1, 2)
        a = F.scaled_dot_product_attention(self.q(h), self.k(ctx), self.v(ctx))
        return x + self.o(a).transpose(1, 2).reshape(B, C, H, W)

class TinyUNet(nn.Module):
    def __init__(self, c=16, ctx=32):
        super().__init__()
        self.inp = nn.Conv2d(4, c, 3, padding=1)
        self.time = nn.Linear(1, c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.attn = CrossAttn(2 * c, ctx)
        self.up = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1)
        self.out = nn.Conv2d(c, 4, 3, padding=1)
    def forward(self, sample, timestep, encoder_hidden_states):
        h = self.inp(sample) + self.time(timestep[:, None].float())[:, :, None, None]
        h = self.attn(F.silu(self.down(h)), encoder_hidden_states)
        return self.out(F.silu(self.up(h)))

def unet():
    return torchledger.AuditSpec(TinyUNet(), {"sample": torch.randn(2, 4, 8, 8), "timestep": torch.randint(0, 1000, (2,)),
                                              "encoder_hidden_states": torch.randn(2, 8, 32)},
                                 loss_fn=lambda o, i: o.float().pow(2).mean())


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=64, sliding_window=16, use_cache=False)
    ids = torch.randint(0, 256, (2, 32))
    return torchledger.AuditSpec(Gemma2ForCausalLM(cfg), {"input_ids": ids, "labels": ids})
'''

_CACHE: dict = {}


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    path = tmp_path_factory.mktemp("issue31") / "models.py"
    path.write_text(MODELS)

    def get(entry, **kw):
        key = (entry, tuple(sorted(kw.items())))
        if key not in _CACHE:
            _CACHE[key] = run_audit(str(path), entry=entry, device="fake", steps=1, timing_steps=0, **kw).record
        return _CACHE[key]
    return get


def _rules(rec, rule):
    from torchledger.analyzers.checks import run_checks
    return [f for f in run_checks([rec], {}) if f.rule == rule]


# --- item 1: attention-free models get no attention reference ------------------------------------

@pytest.mark.parametrize("entry", ["ssm", "mamba2"])
def test_state_space_no_false_cmp001(audit, entry):
    if entry == "mamba2":
        pytest.importorskip("transformers")
    rec = audit(entry)
    assert rec.meta["config"]["mixer"] == "state-space"
    assert not _rules(rec, "TL-CMP-001")
    p = predictions(rec)
    for key in ("flops_6nd_attention", "params_12ld2", "activation_bytes_korthikanti_16bit", "params_exact"):
        assert key not in p, key
    rows = {r["quantity"]: r for r in comparisons(rec)}
    assert not any("12LTd" in q or "Korthikanti" in q or "parameters" in q for q in rows), list(rows)
    flops = [r for q, r in rows.items() if q.startswith("training FLOPs")]
    assert len(flops) == 1
    text = flops[0]["explanation"]
    assert "a state-space model, no attention" in text and "not compared" in text
    assert "the scan's matmul work" in text and "GELU MLP (this one" not in text


def test_state_space_trace_api_no_false_cmp001():
    ns: dict = {}
    exec(MODELS, ns)
    model = ns["TinySSM"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 128, (2, 16))
    with torchledger.trace(model, opt, tokens=32) as t:      # no seq_len
        model(ids, ids).backward(); opt.step(); opt.zero_grad()
    assert not [f for f in t.findings() if f.rule == "TL-CMP-001"]


def test_attention_model_keeps_its_references(audit):
    pytest.importorskip("transformers")
    rec = audit("gemma2")
    assert "mixer" not in rec.meta["config"]
    assert "flops_6nd_attention" in predictions(rec)


# --- item 2: D from a tensor that is not a token-id sequence --------------------------------------

def _ns():
    ns: dict = {}
    exec(MODELS, ns)
    return ns


def test_unet_counts_samples_and_warns(audit):
    from torchledger.record import counts_samples
    rec = audit("unet")
    t = rec.totals
    assert t["tokens"] == 2 and counts_samples(t), t["tokens_source"]    # was 16: rows of encoder_hidden_states
    said = [w for w in rec.warnings if "tokens per step (D) = 2 samples" in w]
    assert len(said) == 1 and "inputs['encoder_hidden_states'] [2, 8, 32] beside it is not counted" in said[0]
    assert "AuditSpec(tokens=..., seq_len=...)" in said[0]


@pytest.mark.parametrize("entry", ["dlrm", "dlrm2d"])
def test_recommender_counts_samples_and_warns(audit, entry):
    from torchledger.record import counts_samples
    rec = audit(entry)
    t = rec.totals
    assert t["tokens"] == 8 and counts_samples(t), t["tokens_source"]    # dlrm2d was 40: numel of sparse ids
    assert not rec.meta.get("seq_len") and not rec.meta["audit"]["seq_len"]    # no T from the bags either
    said = [w for w in rec.warnings if "nn.EmbeddingBag tables" in w]
    assert len(said) == 1 and "AuditSpec(tokens=..., seq_len=...)" in said[0], rec.warnings
    assert not [r for r in comparisons(rec) if r["quantity"] == "training FLOPs vs 6ND"]


def test_infer_tokens_rule():
    from torchledger.audit.spec import infer_tokens, tokens_warning
    ns = _ns()
    unet = ns["unet"]().inputs
    assert infer_tokens(unet).tokens == 2 and tokens_warning(unet) is not None
    spec = ns["dlrm2d"]()
    assert infer_tokens(spec.inputs).tokens == 40                # no model: 2-D ids are token ids
    assert infer_tokens(spec.inputs, spec.model).tokens == 8     # EmbeddingBag lookups: samples
    # token ids, images alone and float rows alone stay as they were, with no warning
    for inputs in ({"input_ids": torch.randint(0, 9, (2, 8))}, torch.randn(4, 3, 8, 8), torch.randn(4, 16)):
        assert tokens_warning(inputs) is None


# --- item 3: trace() and Ledger infer T as the audit does -------------------------------------------

def _gemma_step(ns, **kw):
    torch.manual_seed(0)
    spec = ns["gemma2"]()
    model, inputs = spec.model, spec.inputs
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, opt, tokens=64, **kw) as t:
        model(**inputs).loss.backward(); opt.step(); opt.zero_grad()
    return t


def test_trace_infers_seq_len_like_audit(audit):
    pytest.importorskip("transformers")
    ns = _ns()
    audited = audit("gemma2")
    traced = _gemma_step(ns)                 # no seq_len: read off input_ids [2, 32]
    assert traced.record.meta["seq_len"] == audited.meta["audit"]["seq_len"] == 32
    assert traced.record.meta["seq_len_source"] == "last dim of inputs['input_ids'] [2, 32]"
    assert not [f for f in traced.findings() if f.rule == "TL-CMP-001"]
    assert not _rules(audited, "TL-CMP-001")
    assert (predictions(traced.record)["flops_6nd_attention"] == predictions(audited)["flops_6nd_attention"])
    given = _gemma_step(ns, seq_len=16)      # a given seq_len wins
    assert given.record.meta["seq_len"] == 16 and "seq_len_source" not in given.record.meta


def test_ledger_infers_seq_len():
    pytest.importorskip("transformers")
    ns = _ns()
    spec = ns["gemma2"]()
    model, inputs = spec.model, spec.inputs
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    with ledger.step(tokens=64):
        model(**inputs).loss.backward(); opt.step(); opt.zero_grad()
    assert ledger.records[-1].meta["seq_len"] == 32


# --- items 4 and 5: --gpu predictions say what they price; hints know what is applied -------------

def _cli_audit(tmp_path, *args):
    import json
    import os
    from click.testing import CliRunner
    from torchledger.cli import cli
    from torchledger.record import StepRecord
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt2_tiny.py")
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    res = CliRunner().invoke(cli, ["audit", tiny, "--steps", "1", "--world-size", "8", "--gpu", "h100", *args,
                                   "--format", "json", "--output", str(out)])
    assert res.exit_code in (0, 1), res.output
    rec = StepRecord.from_dict(json.loads(out.read_text()))
    res = CliRunner().invoke(cli, ["report", str(out)])
    assert res.exit_code == 0, res.output
    return rec, res.output


def test_gpu_prediction_header_says_precision_kernels_layout(tmp_path):
    _, fp32 = _cli_audit(tmp_path)
    lines = fp32.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("predicted step time on H100 SXM"))
    assert lines[at + 1] == "  as: precision fp32, kernels eager, layout dp 8 (8 GPUs)"
    assert lines[at + 2] == "  fp32 training, priced at the fp32 peak: for mixed precision ask --precision bf16-mixed"
    _, mixed = _cli_audit(tmp_path, "--precision", "bf16-mixed")
    assert "  as: precision bf16-mixed, kernels eager, layout dp 8 (8 GPUs)" in mixed.splitlines()
    assert "fp32 training" not in mixed


def test_mem002_hint_knows_mixed_precision_is_applied(tmp_path):
    from torchledger.analyzers.fit import check_gpu_fit
    hints = {}
    for name, args in (("fp32", ()), ("bf16-mixed", ("--precision", "bf16-mixed"))):
        rec, _ = _cli_audit(tmp_path, *args)
        rec.totals["peak_bytes"] = 10 ** 12             # 1 TB: no H100 holds it
        (f,) = check_gpu_fit([rec], {"gpu": "h100"})
        assert f.severity == "error"
        hints[name] = f.hint
    assert "use mixed precision" in hints["fp32"] and "already applied" not in hints["fp32"]
    assert "use mixed precision" not in hints["bf16-mixed"]
    assert "mixed precision (--precision bf16-mixed) already applied" in hints["bf16-mixed"]


def test_net001_says_micro_batch_bytes_beside_step_time(tmp_path):
    _, report = _cli_audit(tmp_path, "--micro-batches", "8")
    (msg,) = [line for line in report.splitlines() if "TL-NET-001" in line]
    assert "of bus bytes per micro-batch (the traced one of the step's 8)" in msg
    assert "the step's collectives take" in msg and "(one micro-batch: all_gather" in msg
    _, one = _cli_audit(tmp_path)
    (msg,) = [line for line in one.splitlines() if "TL-NET-001" in line]
    assert "of bus bytes per step on each of 8 ranks' links take" in msg
    # --link-bandwidth: bytes and compute both the traced micro-batch's, and it says so
    _, link = _cli_audit(tmp_path, "--micro-batches", "8", "--link-bandwidth", "100GB/s")
    (msg,) = [line for line in link.splitlines() if "TL-NET-001" in line]
    assert "of bus bytes per micro-batch (the traced one of the step's 8) on each of 8 ranks' links (" in msg
