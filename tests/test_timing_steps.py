"""MFU's step time on cpu/cuda (issue 20, item 5): enough untraced steps after an untimed
warm-up, as many as ``--timing-steps`` asks (default: 3 to 20 until they add up to 0.5 s),
and the report says how many and how far apart they were. Clocks are fake where a count
depends on durations; no test here measures real time."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from click.testing import CliRunner

import torchledger
from torchledger.analyzers.mfu import mfu_totals, timing_summary
from torchledger.audit.engine import AUTO_MAX_STEPS, AUTO_MIN_STEPS, run_audit, time_untraced
from torchledger.cli import cli


def _clocked(durations):
    """A Ledger on a fake clock and a step that takes the next of ``durations`` (seconds)."""
    now = [0.0]
    ledger = torchledger.Ledger(torch.nn.Linear(2, 2), clock=lambda: now[0])
    todo = iter(durations)
    calls = []

    def step():
        calls.append(1)
        now[0] += next(todo)
    return ledger, step, calls


@pytest.mark.parametrize("seconds, timed", [     # binary fractions: the fake clock adds exactly
    (2 ** -10, AUTO_MAX_STEPS),    # 20 x ~1 ms = 20 ms < 0.5 s: the cap, 20
    (0.125, 4),                    # 4 x 0.125 = 0.5 s after the 4th
    (0.25, AUTO_MIN_STEPS),        # 2 x 0.25 = 0.5 s, but never fewer than 3
    (32.0, AUTO_MIN_STEPS),        # a slow step: 3
])
def test_auto_times_enough_steps_after_a_warm_up(seconds, timed):
    # the warm-up step takes 8 s (first untraced step: caches, a compile) and is not timed
    ledger, step, calls = _clocked([8.0] + [seconds] * 100)
    assert time_untraced(ledger, step) == 1
    assert len(calls) == 1 + timed
    assert ledger.untraced_seconds == [seconds] * timed


def test_the_user_sets_the_count_and_zero_times_nothing():
    ledger, step, calls = _clocked([1.0] * 20)
    assert time_untraced(ledger, step, 7) == 1 and len(ledger.untraced_seconds) == 7 and len(calls) == 8
    ledger, step, calls = _clocked([])
    assert time_untraced(ledger, step, 0) == 0 and calls == [] and ledger.untraced_seconds == []


def test_timing_summary_by_hand():
    t = timing_summary([0.012, 0.010, 0.011, 0.030], warmup_steps=1)
    # sorted 10, 11, 12, 30 ms: upper median 12 ms; spread (30 - 10) / 12 = 1.667
    assert t == {"steps": 4, "warmup_steps": 1, "median_seconds": 0.012, "min_seconds": 0.010,
                 "max_seconds": 0.030, "spread": pytest.approx(20 / 12)}
    assert timing_summary([]) == {}


def test_mfu_source_says_how_many_steps_and_their_spread():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with torchledger.trace(model) as t:
        model(torch.randn(4, 8)).sum().backward()
    rec = t.record
    rec.meta["device"] = "cpu"
    got = mfu_totals([rec], {"peak_flops": 1e9, "step_seconds": 0.012, "untraced_steps": 4,
                             "untraced_seconds": [0.012, 0.010, 0.011, 0.030], "warmup_steps": 1})
    assert got["mfu_source"].startswith("median of 4 untraced steps after 1 untimed warm-up step, 12 ms "
                                        "(min 10 ms, max 30 ms: spread 166.7%)"), got["mfu_source"]
    assert got["step_timing"]["steps"] == 4
    # forward 2*4*8*8 = 512, backward (weight grad only: the input needs none) 512: 1,024 FLOPs
    assert got["mfu"] == pytest.approx(1024 / 0.012 / 1e9)


def test_ledger_report_prints_the_spread():
    now = [0.0]
    model = torch.nn.Linear(8, 8)
    ledger = torchledger.Ledger(model, sample_every=4, clock=lambda: now[0], peak_flops=1e9)
    for i, dt in enumerate([5.0, 0.010, 0.020, 0.040]):       # one traced step, three untraced
        with ledger.step(tokens=4):
            model(torch.randn(4, 8)).sum().backward()
            now[0] += dt
    text = ledger.report()
    # 10, 20, 40 ms: median 20 ms, spread (40 - 10) / 20 = 150%
    assert "median of 3 untraced steps, 20 ms (min 10 ms, max 40 ms: spread 150.0%)" in text, text
    assert ledger.records[-1].totals["step_timing"]["spread"] == pytest.approx(1.5)


SPEC = """
    import torch
    import torchledger

    def audit_spec():
        return torchledger.AuditSpec(torch.nn.Linear(4, 3), torch.randn(2, 4))
"""


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("timing") / "m.py"
    path.write_text(textwrap.dedent(SPEC))
    return str(path)


def test_cli_timing_steps_reach_the_record(spec_file):
    r = CliRunner().invoke(cli, ["audit", spec_file, "--device", "cpu", "--steps", "1", "--timing-steps", "6",
                                 "--peak-flops", "1T", "--format", "json"])
    assert r.exit_code in (0, 1), r.output
    totals = json.loads(r.stdout)["totals"]
    assert totals["step_timing"]["steps"] == 6 and totals["step_timing"]["warmup_steps"] == 1
    assert totals["mfu_source"].startswith("median of 6 untraced steps after 1 untimed warm-up step, ")
    t = totals["step_timing"]
    assert t["min_seconds"] <= t["median_seconds"] <= t["max_seconds"]
    assert totals["step_seconds_untraced"] == t["median_seconds"]
    # a saved record keeps it, checked on load like every total
    from torchledger.record import StepRecord
    from torchledger.record.schema import RecordError
    data = json.loads(r.stdout)
    assert StepRecord.from_dict(data).totals["step_timing"] == t
    data["totals"]["step_timing"]["spread"] = -1
    with pytest.raises(RecordError, match="step_timing.spread"):
        StepRecord.from_dict(data)


def test_default_times_between_three_and_twenty(spec_file):
    run = run_audit(spec_file, device="cpu", steps=1)
    assert AUTO_MIN_STEPS <= len(run.untraced_seconds) <= AUTO_MAX_STEPS
    assert run.warmup_steps == 1


@pytest.mark.parametrize("bad", ["-1", "1001", "x"])
def test_bad_timing_steps_is_one_line_exit_2(spec_file, bad):
    r = CliRunner().invoke(cli, ["audit", spec_file, "--device", "cpu", "--timing-steps", bad])
    assert r.exit_code == 2 and "--timing-steps" in r.output and "Traceback" not in r.output


def test_timing_steps_on_a_fake_device_is_one_line_exit_2(spec_file):
    from test_audit_cli import one_line_error      # the one-line-error check CLI tests share
    one_line_error(CliRunner().invoke(cli, ["audit", spec_file, "--timing-steps", "5"]),
                   "--timing-steps 5: times real steps, so it needs --device cpu or cuda")


def test_run_audit_refuses_a_bad_count(spec_file):
    from torchledger.audit.spec import AuditError
    with pytest.raises(AuditError, match="--timing-steps: expected a whole number from 0 to 1000"):
        run_audit(spec_file, device="cpu", timing_steps=-2)
