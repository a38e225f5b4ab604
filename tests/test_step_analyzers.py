"""Analyzers over traced records: comparisons with closed forms, copies, MFU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchledger
from torchledger.analyzers.checks import ALL_CHECKS, run_checks
from torchledger.analyzers.compare import check_comparisons, comparisons, predictions
from torchledger.analyzers.copies import check_copies, copy_table
from torchledger.analyzers.mfu import check_mfu, mfu
from torchledger.models import build_model, example_inputs, get_config
from torchledger.record import StepRecord


_TRACED: dict = {}


def traced(name, device="cpu", batch=2, seq=16, **overrides):
    """The record of one AdamW training step of preset ``name``. Traced once per arguments (the
    same seed, model and inputs: the same step) and deep-copied for each caller, which may edit it."""
    key = (name, device, batch, seq, tuple(sorted(overrides.items())))
    if key not in _TRACED:
        _TRACED[key] = _trace(name, device, batch, seq, **overrides)
    return copy.deepcopy(_TRACED[key])


def _trace(name, device, batch, seq, **overrides):
    cfg = get_config(name).replace(**overrides) if overrides else get_config(name)
    fake = FakeTensorMode() if device == "fake" else None
    if fake:
        fake.__enter__()
    try:
        torch.manual_seed(0)
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters())
        inputs = example_inputs(cfg, batch=batch, seq_len=seq)
        with torchledger.trace(model, optimizer=opt, tokens=batch * seq, seq_len=seq) as t:
            model(**inputs).backward()
            opt.step()
            opt.zero_grad()
    finally:
        if fake:
            fake.__exit__(None, None, None)
    return t.record


def test_flops_match_6nd_plus_attention_exactly():
    rec = traced("gpt2-tiny")
    rows = {r["quantity"]: r for r in comparisons(rec)}
    assert rows["training FLOPs vs 6ND + 12LTd"]["ratio"] == 1.0
    assert rows["parameters (exact formula)"]["ratio"] == 1.0
    # 6ND alone misses the attention term: 12*L*T*d / (6*N) = 12*2*16*64 / (6*131072) = 1/32
    assert rows["training FLOPs vs 6ND"]["ratio"] == pytest.approx(1 + 1 / 32, abs=1e-12)
    assert rec.predictions["flops_6nd_attention"] == rec.totals["flops"]["total"]
    assert check_comparisons([rec]) == []


def test_llama2_7b_static_bytes_are_16_per_param():
    rec = traced("llama2-7b", device="fake", batch=1, seq=8)
    n = rec.totals["params"]
    assert n == 6_738_415_616
    rows = {r["quantity"]: r for r in comparisons(rec)}
    static = rows["static bytes (params+grads+optimizer)"]
    assert static["predicted"] == 16 * n
    n_tensors = 2 + 32 * 9 + 1                      # embeddings, head; 9 per block; final norm
    assert static["measured"] == 16 * n + 4 * n_tensors   # + one fp32 step scalar per tensor
    assert f"{static['ratio']:.3f}" == "1.000"


def test_predictions_need_a_recognised_model():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).sum()
    model = Plain()
    with torchledger.trace(model, tokens=4) as t:
        model(torch.randn(4, 8)).backward()
    p = predictions(t.record)
    assert p["flops_6nd"] == 6 * 64 * 4
    assert "params_exact" not in p and "flops_6nd_attention" not in p
    assert t.record.predictions["flops_6nd_attention"] is None       # INTERFACE keys stay present


class PermuteBack(nn.Module):
    def forward(self, x):
        y = x.permute(0, 2, 1).contiguous()                       # PERMUTE-COPY
        y = y.permute(0, 2, 1)
        return (y * 2).sum()


class RoundTrip(nn.Module):
    def forward(self, x):
        return x.to(torch.bfloat16).to(torch.float32).sum()         # ROUND-TRIP


def _line(marker):
    return next(i for i, s in enumerate(open(__file__).read().splitlines(), 1)
                if s.rstrip().endswith(f"# {marker}"))


@pytest.mark.parametrize("cls, rule, marker", [(PermuteBack, "TL-COPY-003", "PERMUTE-COPY"),
                                              (RoundTrip, "TL-COPY-001", "ROUND-TRIP")])
def test_needless_copies_are_flagged_at_their_line(cls, rule, marker):
    model = cls()
    with torchledger.trace(model) as t:
        model(torch.randn(2, 8, 4, requires_grad=True)).backward()
    found = [f for f in check_copies([t.record]) if f.rule == rule]
    assert len(found) == 1
    assert found[0].location.endswith(f"test_step_analyzers.py:{_line(marker)}")
    # x is (2, 8, 4) fp32, 64 values: the permuted .contiguous() writes 64 x 4 = 256 bytes; the
    # round trip writes 64 x 2 (to bf16) + 64 x 4 (back to fp32) = 384, forward and backward
    assert copy_table(t.record)[0]["bytes"] == {PermuteBack: 256, RoundTrip: 384}[cls]
    assert t.record.totals["copy_bytes"] == {PermuteBack: 256, RoundTrip: 2 * 384}[cls]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_reference_models_have_no_copy_findings(name, device):
    rec = traced(name, device=device)
    assert [f for f in check_copies([rec]) if f.severity != "info"] == []


def test_low_mfu_against_a_huge_peak():
    rec = traced("gpt2-tiny")
    found = check_mfu([rec], {"peak_flops": 1e15})
    assert [f.rule for f in found] == ["TL-MFU-001"]


def test_mfu_by_hand():
    model = build_model("cruncher")
    ticks = iter([10.0, 10.25])
    with torchledger.trace(model, peak_flops=2e9, clock=lambda: next(ticks)) as t:
        model(torch.randn(4, 128)).sum().backward()
    f = t.record.totals["flops"]["total"]
    m, _ = mfu(t.record, 2e9)
    assert abs(m - f / 0.25 / 2e9) < 1e-6
    assert check_mfu([t.record], {"peak_flops": f / 0.25 / 2})[0].rule == "TL-MFU-002"   # MFU 2


def test_no_mfu_for_fake_steps():
    assert check_mfu([traced("gpt2-tiny", device="fake")], {"peak_flops": 1e15}) == []


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_every_check_runs_on_empty_and_reloaded_records(check):
    assert check([], {}) == []
    assert isinstance(check([StepRecord()], {}), list)
    rec = StepRecord.from_json(traced("gpt2-tiny").to_json())
    assert isinstance(check([rec], {"peak_flops": 1e12}), list)
    assert run_checks([rec]) == run_checks([StepRecord.from_json(rec.to_json())])


def test_flops_below_6nd_are_explained_as_skipped_input_grads():
    model = build_model("cruncher")
    with torchledger.trace(model, tokens=4) as t:
        model(torch.randn(4, 128)).sum().backward()
    row = next(r for r in comparisons(t.record) if r["quantity"] == "training FLOPs vs 6ND")
    # 6ND counts the first layer's input gradient (2*B*D*D) that x (no grad) does not need
    assert row["measured"] == row["predicted"] - 2 * 4 * 128 * 128
    assert "not needed" in row["explanation"]


def test_ledger_times_untraced_steps_for_mfu():
    model = build_model("cruncher")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ticks = iter(float(i) for i in range(1000))
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=2, clock=lambda: next(ticks))
    for _ in range(4):
        with ledger.step(tokens=4):
            model(torch.randn(4, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(ledger.records) == 2 and list(ledger.untraced_seconds) == [1.0, 1.0]
    flops = ledger.records[-1].totals["flops"]["total"]
    found = ledger.findings(peak_flops=flops * 100)              # MFU = flops / 1 s / peak = 0.01
    mfu_finding = next(f for f in found if f.rule == "TL-MFU-001")
    assert mfu_finding.measured == pytest.approx(0.01, rel=1e-9)
    assert "untraced steps" in mfu_finding.message


def test_trace_findings_take_options():
    model = build_model("cruncher")
    with torchledger.trace(model, peak_flops=1e18) as t:
        model(torch.randn(4, 128)).sum().backward()
    assert "TL-MFU-001" in {f.rule for f in t.findings()}
    assert "TL-MFU-001" not in {f.rule for f in t.findings(min_mfu=1e-30)}


class _CachingLM(nn.Module):
    """Returns its keys and values beside the loss, as Hugging Face models do with use_cache."""

    def __init__(self, d=32, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.k, self.v, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        k, v = self.k(x), self.v(x)
        att = torch.softmax(x @ k.transpose(1, 2), dim=-1) @ v
        loss = nn.functional.cross_entropy(self.head(att).flatten(0, 1), ids.flatten())
        return {"loss": loss, "past_key_values": [(k, v)]}


def _cache_step(model, train=True, no_grad=False):
    model.train(train)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (4, 16))
    with torchledger.trace(model, optimizer=opt, tokens=64) as t:
        if no_grad:
            with torch.no_grad():
                model(ids)
        else:
            out = model(ids)
            out["loss"].backward()
            opt.step()
            opt.zero_grad()
    return t


def test_returned_kv_cache_is_measured_and_flagged():
    torch.manual_seed(0)
    t = _cache_step(_CachingLM())
    cache = t.record.memory["output_cache"]
    kv = 2 * 4 * 16 * 32 * 4          # k and v: batch 4 x seq 16 x d 32, fp32 = 16,384 bytes
    assert cache["field"] == "past_key_values" and cache["cache_type"] == "list"
    assert cache["tensors"] == 2 and cache["bytes"] == kv
    assert cache["bytes_at_optimizer"] == kv        # `out` still holds them during opt.step()
    assert t.record.totals["peak_phase"] == "optimizer"          # AdamW's first step allocates state
    (f,) = [f for f in t.findings() if f.rule == "TL-MEM-001"]
    assert f.severity == "warning" and f.measured == kv == cache["bytes_at_peak"]
    assert f"({kv / t.record.totals['peak_bytes']:.1%})" in f.message
    assert "use_cache=False" in f.hint
    again = StepRecord.from_json(t.record.to_json())             # offline: same verdict
    assert [g.to_dict() for g in run_checks([again]) if g.rule == "TL-MEM-001"] == [f.to_dict()]
    # the share that makes it a warning comes from the options
    assert [g.severity for g in t.findings(cache_share=1.0) if g.rule == "TL-MEM-001"] == ["info"]


@pytest.mark.parametrize("train,no_grad", [(False, False), (True, True)])
def test_no_cache_finding_for_eval_or_no_grad_forwards(train, no_grad):
    t = _cache_step(_CachingLM(), train=train, no_grad=no_grad)
    assert "output_cache" not in t.record.memory
    assert not [f for f in t.findings() if f.rule == "TL-MEM-001"]


def _with_peak(peak_bytes, phase="optimizer"):
    rec = StepRecord()
    rec.totals.update(peak_bytes=peak_bytes, peak_phase=phase, param_bytes=10, grad_bytes=10,
                      optimizer_state_bytes=20)
    return rec


H100_BYTES = 79.18 * 2**30      # 85,018,877,624 B: what CUDA reports for an "80 GB" H100


@pytest.mark.parametrize("peak, severity", [
    (H100_BYTES + 1, "error"),             # one byte over the 79.18 GiB an H100 80GB gives a process
    (H100_BYTES, "warning"),               # fits exactly: no room for the CUDA context
    (0.9 * H100_BYTES + 1, "warning"),     # a byte less than 10% headroom
    (0.9 * H100_BYTES, "info"),            # exactly 10% to spare
])
def test_gpu_fit_thresholds_by_hand(peak, severity):
    from torchledger.analyzers.fit import check_gpu_fit
    (f,) = check_gpu_fit([_with_peak(peak)], {"gpu": "H100"})
    assert (f.rule, f.severity, f.measured, f.expected) == ("TL-MEM-002", severity, peak, H100_BYTES)
    assert "H100 SXM" in f.message and "the optimizer step" in f.message
    assert check_gpu_fit([_with_peak(peak)], {}) == []                   # no GPU named: no verdict
    assert check_gpu_fit([_with_peak(peak)], {"gpu": "no-such-gpu"}) == []


def test_gpu_fit_from_a_traced_step():
    rec = traced("gpt2-tiny")
    (f,) = [f for f in run_checks([rec], {"gpu": "A100"}) if f.rule == "TL-MEM-002"]
    assert f.severity == "info" and f.measured == rec.totals["peak_bytes"] and "under 0.1%" in f.message
    # on a GPU it overflows, the hint's static bytes count the gradients that zero_grad freed
    big = StepRecord.from_dict(rec.to_dict())
    big.totals["peak_bytes"] = 10**12
    (f,) = [f for f in run_checks([big], {"gpu": "A100"}) if f.rule == "TL-MEM-002"]
    t = rec.totals
    assert f.severity == "error" and t["grad_bytes"] == t["param_bytes"] > 0
    from torchledger.units import fmt_bytes
    assert fmt_bytes(t["param_bytes"] + t["grad_bytes"] + t["optimizer_state_bytes"]) in f.hint


class NormUpcast(nn.Module):
    """RMSNorm as bf16 models write it: compute in fp32, cast the *result* back (not a round trip)."""
    shape, dtype = (2, 8, 4), torch.bfloat16

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(torch.bfloat16).sum()                # a new value goes back


class TransposeForMatmul(nn.Module):
    """Heads first, materialised, then K^T for Q K^T: the later transpose is a new layout."""
    shape, dtype = (2, 8, 2, 4), torch.float32          # (B, T, heads, head dim)

    def forward(self, x):
        k = x.transpose(1, 2).contiguous()               # (B, heads, T, hd), a copy
        return (k @ k.transpose(-2, -1)).sum()


class ExpandReshape(nn.Module):
    """GQA's repeat_kv: an expanded K must be materialised to be reshaped (stride 0)."""
    shape, dtype = (2, 8, 4), torch.float32

    def forward(self, x):
        k = x[:, :, None].expand(2, 8, 3, 4).reshape(2, 24, 4)
        return (k.transpose(1, 2) @ k).sum()


@pytest.mark.parametrize("cls", [NormUpcast, TransposeForMatmul, ExpandReshape])
def test_needed_casts_and_copies_are_not_flagged(cls):
    model = cls()
    with torchledger.trace(model) as t:
        model(torch.randn(*cls.shape, dtype=cls.dtype, requires_grad=True)).backward()
    assert t.record.copies                                   # the copies are there, and counted
    assert not [f.rule for f in t.findings() if f.rule in ("TL-COPY-001", "TL-COPY-003")]


def test_round_trip_finding_counts_both_casts():
    model = RoundTrip()
    with torchledger.trace(model) as t:
        model(torch.randn(2, 8, 4, requires_grad=True)).backward()
    (f,) = [f for f in t.findings() if f.rule == "TL-COPY-001"]
    # 64 values: fp32 -> bf16 writes 128 bytes, bf16 -> fp32 reads 128 and writes 256: 128 + 256 = 384
    assert f.measured == 64 * 2 + 64 * 4 == 384 and "float32 -> bfloat16 -> float32" in f.message


def test_weights_that_see_fewer_tokens_are_explained_per_weight():
    """A classifier head that reads only the CLS row: 6ND counts it for every token; the
    per-weight prediction 6 x sum(P x rows) does not, and no TL-CMP-001 fires."""
    from torchledger.analyzers.compare import check_comparisons
    rec = traced("gpt2-tiny")
    t = rec.totals
    assert rec.predictions.get("flops_6nd_per_weight") == rec.predictions["flops_6nd"]   # all rows
    assert not check_comparisons([rec])
    # now the LM head (V x d, tied) multiplies 1 row of the D tokens, not D: take its FLOPs away
    V, d, D = 512, 64, t["tokens"]
    head_fwd = 2 * V * d * D
    t["flops"]["total"] -= 3 * head_fwd - 3 * 2 * V * d          # fwd + bwd of D rows -> of 1 row
    t["param_matmul_flops_forward"] -= head_fwd - 2 * V * d
    t["param_matmul_flops_grad"] -= 2 * (head_fwd - 2 * V * d)     # its two gradients, likewise
    from torchledger.analyzers.compare import predictions
    assert predictions(rec)["flops_6nd_per_weight"] == 3 * t["param_matmul_flops_forward"]
    assert not [f for f in check_comparisons([rec]) if f.rule == "TL-CMP-001"]
    del t["param_matmul_flops_forward"]                              # an older record: 6ND only
    assert [f.rule for f in check_comparisons([rec])] == ["TL-CMP-001"]


@pytest.mark.parametrize("device, fires", [("fake", True), ("cpu", False), ("meta", False)])
def test_fake_rnn_workspace_gap_is_stated(device, fires):
    """PyTorch's fake kernel of oneDNN's LSTM returns an empty workspace (the real one keeps
    it for backward): on fake tensors the report must say its bytes are missing. On cpu the
    workspace is measured; on meta the LSTM decomposes into mm ops and has no workspace."""
    from torchledger.analyzers.checks import check_fake_kernel_gaps
    from torchledger.record import StepRecord

    with FakeTensorMode() if device == "fake" else torch.device(device):
        lstm, x = nn.LSTM(8, 16), torch.randn(5, 2, 8)
        model = nn.ModuleDict({"rnn": lstm})
        with torchledger.trace(model) as t:
            lstm(x)[0].sum().backward()
    found = [f for f in t.findings() if f.rule == "TL-FAKE-001"]
    assert [f.module for f in found] == (["rnn"] if fires else [])
    if fires:
        assert found[0].severity == "warning" and "mkldnn_rnn_layer" in found[0].message
        again = check_fake_kernel_gaps([StepRecord.from_dict(t.record.to_dict())])
        assert [f.message for f in again] == [found[0].message]
