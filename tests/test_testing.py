"""torchledger.testing.assert_step: budgets, findings, baselines and bad arguments.

The step: ``Sequential(Linear(8, 4), Linear(4, 2))``, no bias, on a (2, 8) input that needs
no grad, SGD, tokens=2. By hand (as in test_pytest_plugin.py):
    FLOPs: forward 2*2*8*4 + 2*2*4*2 = 160; backward 128 + (32 + 32) = 192; total 352
    FLOPs per token: 352 / 2 = 176
    activations: x 2*8*4 = 64 B and the hidden 2*4*4 = 32 B -> 96 B
    params: 8*4 + 4*2 = 40 -> 160 B in float32
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchledger
from torchledger.record import Finding, StepRecord
from torchledger.testing import as_record, assert_step

TOTAL, PER_TOKEN, ACT, PARAMS = 352, 176, 96, 40


def _trace(hidden=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden, bias=False), torch.nn.Linear(hidden, 2, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)
    with torchledger.trace(model, optimizer=opt, tokens=2) as t:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return t


@pytest.fixture(scope="module")
def traced():
    return _trace()


@pytest.fixture
def record(traced):
    return copy.deepcopy(traced.record)


def test_the_step_is_what_the_arithmetic_says(record):
    t = record.totals
    assert (t["flops"]["forward"], t["flops"]["backward"], t["flops"]["total"]) == (160, 192, TOTAL)
    assert (t["activation_bytes"], t["params"], t["param_bytes"]) == (ACT, PARAMS, 4 * PARAMS)


def test_budgets_met_pass_and_return_the_record(traced, record):
    out = assert_step(traced, max_peak_bytes="1MiB", max_flops_per_token=PER_TOKEN, no_findings_at="warning",
                      max_flops=TOTAL, max_activation_bytes=ACT, max_param_bytes=4 * PARAMS, max_params=PARAMS)
    assert out is traced.record                          # equal to the budget passes
    assert assert_step(record.to_dict(), max_flops="352") .totals["flops"]["total"] == TOTAL
    assert assert_step(record, max_peak_bytes=record.totals["peak_bytes"]) is record


@pytest.mark.parametrize("budget, parsed", [("2GB", 2e9), ("1.5GiB", 1.5 * 2**30), ("7e9", 7e9), (1024, 1024)])
def test_size_budgets_parse_like_the_cli(record, budget, parsed):
    peak = record.totals["peak_bytes"]
    record.totals["peak_bytes"] = int(parsed) + 1        # one byte over: the message says so
    with pytest.raises(AssertionError, match=r"over by 1 B \(\+0\.[01]%\)"):   # 1/1024 = +0.1%
        assert_step(record, max_peak_bytes=budget)
    record.totals["peak_bytes"] = peak
    assert_step(record, max_peak_bytes=budget)


def test_every_broken_budget_is_named_with_its_excess(record):
    with pytest.raises(AssertionError) as e:
        assert_step(record, max_flops="300", max_flops_per_token=200, max_params=39, max_param_bytes="100")
    msg = str(e.value)
    assert "FLOPs (forward + backward + optimizer): 352 > max_flops 300, over by 52 (+17.3%)" in msg  # 52/300
    assert "max_flops_per_token" not in msg             # 176 <= 200: met, not listed
    assert "parameters: 40 > max_params 39, over by 1 (+2.6%)" in msg                                # 1/39
    assert "parameter bytes: 160 B > max_param_bytes 100 B, over by 60 B (+60.0%)" in msg
    # the module tables behind them: FLOPs 256 (72.7%) and 96; params 32 of 40 (80.0%) and 8
    assert "0         Linear  256    72.7%    256" in msg
    assert "0         Linear  32     80.0%    32" in msg
    assert "1         Linear  8      20.0%    8" in msg


def test_large_numbers_read_both_ways(record):
    record.totals["peak_bytes"] = 3 * 2**30
    with pytest.raises(AssertionError, match=r"peak bytes: 3,221,225,472 B = 3\.2 GB \(3\.0 GiB\) > max_peak_bytes "
                                             r"2,000,000,000 B = 2\.0 GB \(1\.9 GiB\)"):
        assert_step(record, max_peak_bytes="2GB")


def test_findings_at_or_above_the_severity_fail(record):
    record.warnings.append("could not record part of the step")      # check_tracer_warnings: warning
    assert_step(record, no_findings_at="error")
    with pytest.raises(AssertionError, match=r"1 finding\(s\) at or above 'warning':\n    warning TL-TRACE-001: "
                                             r"could not record part of the step"):
        assert_step(record, no_findings_at="warning")
    assert_step(record, no_findings_at="warning", ignore=["tl-trace-001"])


def test_stored_findings_count_too(record):
    d = record.to_dict()
    d["findings"] = [Finding("TL-LEAK-001", "error", "activations grow every step", module="0").to_dict()]
    with pytest.raises(AssertionError, match=r"error TL-LEAK-001 \[module 0\]: activations grow every step"):
        assert_step(d, no_findings_at="info")
    assert_step(d, no_findings_at=None)


def test_growth_over_a_baseline_fails_with_each_module_change(record):
    wider = _trace(hidden=8).record
    # hidden 4 -> 8: forward 2*2*8*8 + 2*2*8*2 = 320, backward 256 + 64 + 64 = 384; total 704 = 2 x 352
    with pytest.raises(AssertionError) as e:
        assert_step(wider, baseline=record)
    msg = str(e.value)
    assert "baseline: FLOPs grew +100.00% over the baseline (352 -> 704; tolerance 1%)" in msg
    # layer 0: 512 - 256 = +256 FLOPs; layer 1: (64 + 128) - 96 = +96 FLOPs, +32 B saved (the wider hidden)
    assert "0         changed   +256" in msg and "1         changed   +96      +32" in msg
    assert_step(record, baseline=record.to_dict())
    # FLOPs and params grew +100%, activations 96 -> 128 B (+33%): all within a 150% tolerance
    assert_step(wider, baseline=record, tolerance=1.5)


def test_inputs_of_every_kind(traced, record, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(record.to_json())
    for obj in (traced, traced.record, record.to_dict(), str(path), path):
        assert isinstance(as_record(obj), StepRecord)
    with pytest.raises(AssertionError, match="FLOPs per token: 176 > max_flops_per_token 175, over by 1"):
        assert_step(path, max_flops_per_token=175)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_peak_bytes": "2XB"}, ValueError, "max_peak_bytes: expected a size such as 80GB or 80GiB, got '2XB'"),
    ({"max_flops": "2GB"}, ValueError, "max_flops: expected a FLOP count such as 5e10, 7B, 1.5T or 2GFLOP"),
    ({"max_flops_per_token": float("nan")}, ValueError, "max_flops_per_token: expected a finite, positive budget"),
    ({"max_flops": float("inf")}, ValueError, "max_flops: expected a finite, positive budget, got inf"),
    ({"max_params": 0}, ValueError, "max_params: expected a finite, positive budget, got 0"),
    ({"max_peak_bytes": True}, TypeError, "max_peak_bytes: expected a number or a string"),
    ({"max_flops": [1]}, TypeError, "max_flops: expected a number or a string"),
    ({"no_findings_at": "warn"}, ValueError, "no_findings_at: expected one of error, warning, info or None"),
    ({"ignore": ["TL-NOPE-001"]}, ValueError, "ignore: unknown rule id 'TL-NOPE-001'"),
    ({"top": 0}, ValueError, "top: expected an int >= 1"),
    ({"tolerance": -0.1}, ValueError, "tolerance: expected a fraction >= 0"),
])
def test_bad_arguments_say_what_was_expected(record, kwargs, error, message):
    with pytest.raises(error) as e:
        assert_step(record, **kwargs)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_records_say_what_was_expected(record, tmp_path):
    with pytest.raises(TypeError, match="record: expected a StepRecord, a finished trace, a record dict or "
                                        "the path of a record JSON file, got int"):
        assert_step(42)
    with pytest.raises(ValueError, match="no such file; expected a record JSON file"):
        assert_step(tmp_path / "missing.json")
    open_trace = torchledger.trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="the trace has no record yet"):
        assert_step(open_trace)
    record.totals["tokens"] = 0
    with pytest.raises(ValueError, match="the record has no tokens, so no FLOPs per token; pass tokens="):
        assert_step(record, max_flops_per_token=1e9)
