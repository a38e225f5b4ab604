"""Closed-form predictions that a planted bug once slipped past: the causal-halved
6ND + attention prediction of a decoder-only model, exact to the FLOP."""
from __future__ import annotations

import pytest
import torch

import torchledger
from torchledger.analyzers.compare import check_comparisons, predictions
from torchledger.models import build_model, example_inputs


@pytest.fixture(scope="module")
def gpt2_tiny_record():
    torch.manual_seed(0)
    model = build_model("gpt2-tiny")                  # V=512, d=64, L=2, H=4, causal
    opt = torch.optim.AdamW(model.parameters())
    batch = example_inputs("gpt2-tiny", batch=2, seq_len=16)
    with torchledger.trace(model, optimizer=opt, tokens=32, seq_len=16) as t:
        model(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return t.record


def test_decoder_only_causal_prediction_halves_the_attention_term(gpt2_tiny_record):
    rec = gpt2_tiny_record
    assert rec.warnings == []
    p = predictions(rec)
    # N = 131,072 matmul params (4 x 64^2 attention + 8 x 64^2 MLP per layer x 2 layers = 98,304,
    # + the tied 512 x 64 LM head = 32,768), D = 32 tokens: 6ND = 6 x 131,072 x 32 = 25,165,824
    assert rec.totals["matmul_params"] == 131_072
    assert p["flops_6nd"] == 25_165_824
    # attention 12 L T d D = 12 x 2 x 16 x 64 x 32 = 786,432 dense; causal halves it: 393,216
    assert p["flops_6nd_attention"] == 25_165_824 + 786_432
    assert p["flops_6nd_attention_causal"] == 25_165_824 + 393_216
    # the measured attention agrees with both halves of the prediction
    # the CPU flash backward recomputes Q K^T: a quarter of its 2 x 262,144 backward, hardware only
    assert rec.totals["attention_flops"] == {"dense": 786_432, "causal": 393_216, "score_recompute": 131_072}
    # the record's own predictions (made at trace time) are the same numbers
    assert rec.predictions["flops_6nd_attention_causal"] == 25_559_040
    row = next(r for r in rec.predictions["comparisons"] if r["quantity"] == "training FLOPs vs 6ND + 12LTd")
    assert "causal-halved prediction 25,559,040" in row["explanation"]


def test_a_clean_gpt2_tiny_step_has_no_warnings(gpt2_tiny_record):
    rec = gpt2_tiny_record
    assert rec.warnings == []
    # every part of the record was filled: retention, allocator, predictions
    assert rec.memory["retained"] == [] and rec.memory["retained_new"]["count"] >= 0
    assert rec.memory["grads"]["optimizer_steps"] == 1
    assert rec.memory["allocator"]["available"] is False
    assert rec.predictions["comparisons"]


def test_flops_comparison_finding_ran_and_passes(gpt2_tiny_record):
    rec = gpt2_tiny_record
    # measured 25,952,256 = 6ND + dense attention exactly: no TL-CMP-001 at any tolerance
    assert rec.totals["flops"]["total"] == 25_952_256
    found = check_comparisons([rec], {"tolerance": 1e-9})
    assert [f.rule for f in found] == ["TL-CMP-002"]
    # static bytes: 16 x 141,056 params predicted = 2,256,896; measured adds AdamW's fp32 step
    # scalar per parameter tensor: 36 tensors x 4 bytes = 144 (within the default 5%)
    assert (found[0].measured, found[0].expected) == (2_256_896 + 36 * 4, 2_256_896)
    assert check_comparisons([rec], {"tolerance": 0.05}) == []
    # positive twin: the same record with 10% more matmul work is flagged
    rec.totals["flops"]["total"] = int(25_952_256 * 1.1)
    try:
        (f,) = [f for f in check_comparisons([rec], {"tolerance": 0.05}) if f.rule == "TL-CMP-001"]
        assert f.expected == 25_952_256 and f.severity == "warning"
    finally:
        rec.totals["flops"]["total"] = 25_952_256


def _copy(rec, **totals):
    import copy
    out = copy.deepcopy(rec)
    out.totals.update(totals)
    return out


def test_flops_gap_is_a_share_of_the_prediction_either_way(gpt2_tiny_record):
    rec = gpt2_tiny_record
    explained = 25_952_256
    more = _copy(rec, flops={**rec.totals["flops"], "total": int(explained * 1.1)})
    # gap = (measured - predicted) / predicted = (1.1 - 1) / 1 = 10.0% above the prediction
    assert [f.rule for f in check_comparisons([more], {"tolerance": 0.105})] == []
    (f,) = [f for f in check_comparisons([more], {"tolerance": 0.095}) if f.rule == "TL-CMP-001"]
    assert "(28,547,481) are 10.0% above 6ND + 12LTd attention (25,952,256)" in f.message
    less = _copy(rec, flops={**rec.totals["flops"], "total": int(explained * 0.9)})
    assert [f.rule for f in check_comparisons([less], {"tolerance": 0.105})] == []
    (f,) = [f for f in check_comparisons([less], {"tolerance": 0.095}) if f.rule == "TL-CMP-001"]
    assert "(23,357,030) are 10.0% below 6ND + 12LTd attention (25,952,256)" in f.message      # (0.9 - 1) / 1


def test_flops_gap_is_only_info_without_an_exact_config(gpt2_tiny_record):
    import copy
    rec = copy.deepcopy(gpt2_tiny_record)
    rec.totals["flops"]["total"] = int(25_952_256 * 1.2)
    (f,) = [f for f in check_comparisons([rec]) if f.rule == "TL-CMP-001"]
    assert f.severity == "warning"
    rec.meta["config"]["partial"] = True                  # L, d, V found from the modules only
    (f,) = [f for f in check_comparisons([rec]) if f.rule == "TL-CMP-001"]
    assert f.severity == "info"
    assert f.expected == 25_165_824 + 786_432             # 6ND + the measured dense attention


def test_static_bytes_below_the_prediction_is_flagged(gpt2_tiny_record):
    # no optimizer state at all: 4 + 4 bytes/param measured against AdamW's 16
    rec = _copy(gpt2_tiny_record, optimizer_state_bytes=0)
    (f,) = [f for f in check_comparisons([rec]) if f.rule == "TL-CMP-002"]
    assert (f.measured, f.expected) == (8 * 141_056, 16 * 141_056)


def test_checks_read_the_latest_record(gpt2_tiny_record):
    rec = gpt2_tiny_record
    more = _copy(rec, flops={**rec.totals["flops"], "total": int(25_952_256 * 1.5)})
    assert "TL-CMP-001" in [f.rule for f in check_comparisons([rec, more])]
    assert "TL-CMP-001" not in [f.rule for f in check_comparisons([more, rec])]


def test_attention_term_runs_at_heads_times_head_dim(gpt2_tiny_record):
    import copy
    rec = copy.deepcopy(gpt2_tiny_record)
    rec.meta["config"]["d_attn"] = 32                     # heads x head_dim apart from d = 64
    p = predictions(rec)
    # 12 L T d_attn D = 12 x 2 x 16 x 32 x 32 = 393,216; causal half 196,608
    assert p["flops_6nd_attention"] == 25_165_824 + 393_216
    assert p["flops_6nd_attention_causal"] == 25_165_824 + 196_608


def test_flops_check_uses_the_closed_form_attention_not_the_measured(gpt2_tiny_record):
    # attention doing twice its closed-form work (2 x 786,432) is unexplained FLOPs: the check
    # compares with 6ND + 12LTdD, not with 6ND + whatever attention was measured
    rec = _copy(gpt2_tiny_record, attention_flops={"dense": 2 * 786_432, "causal": 786_432},
                flops={**gpt2_tiny_record.totals["flops"], "total": 25_165_824 + 2 * 786_432})
    (f,) = [f for f in check_comparisons([rec], {"tolerance": 0.01}) if f.rule == "TL-CMP-001"]
    assert f.expected == 25_952_256
    # 786,432 / 25,952,256 = 3.0% above the prediction
    assert "(26,738,688) are 3.0% above 6ND + 12LTd attention (25,952,256)" in f.message
