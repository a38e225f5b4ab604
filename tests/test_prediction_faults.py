"""Faults on the prediction surfaces (issue 32): hostile hardware files, ``--timeout``, records
the schema accepts, limits, and digits that are not ASCII. Each input here was a traceback
or a silently wrong output before; now it is one line on stderr and exit 2 (or a report)."""
from __future__ import annotations

import json
import os

import pytest

from test_audit_cli import one_line_error, run, write

LINEAR = """
    import torch, torchledger
    def audit_spec():
        return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
"""


# -- 1. TORCHLEDGER_HARDWARE: every field checked when the file is read --------------------------
#: name -> (the file's text, what the error line must name besides the file)
HOSTILE_HARDWARE = {
    "NaN memory": ('{"H100": {"memory": NaN}}', ["part 'H100'", "memory", "got NaN"]),
    "Infinity peak": ('{"H100": {"peak_flops": {"bf16": Infinity}}}', ["peak_flops.bf16", "Infinity"]),
    "negative bandwidth": ('{"H100": {"bandwidth": -3.35e12}}', ["bandwidth", "> 0"]),
    "absurd sm_count": ('{"H100": {"sm_count": 1e30}}', ["sm_count", "whole number"]),
    "fractional sm_count": ('{"H100": {"sm_count": 13.5}}', ["sm_count"]),
    "negative launch_s": ('{"H100": {"efficiency": {"launch_s": -1}}}', ["efficiency.launch_s"]),
    "misspelt efficiency key": ('{"H100": {"efficiency": {"matmul_peak_fracton": 0.5}}}',
                                ["'matmul_peak_fracton'", "did you mean 'matmul_peak_fraction'"]),
    "misspelt field": ('{"H100": {"memroy": "80GB"}}', ["'memroy'", "did you mean 'memory'"]),
    "aliases a string": ('{"Z9": {"memory": "8GB", "bandwidth": "1TB/s", "peak_flops": {"bf16": "1T"}, '
                         '"aliases": "xyz"}}', ["part 'Z9'", "aliases", "a list of names"]),
    "alias not a string": ('{"H100": {"aliases": [1]}}', ["aliases[0]"]),
    "unit typo": ('{"H100": {"memory": "80XB"}}', ["memory", "'80XB'"]),
    "memory a boolean": ('{"H100": {"memory": true}}', ["memory", "got true"]),
    "fraction above 1": ('{"H100": {"efficiency": {"matmul_peak_fraction": 7}}}', ["matmul_peak_fraction"]),
    "attention fraction": ('{"H100": {"efficiency": {"attention": {"flash": [0.5, 2]}}}}',
                           ["efficiency.attention.flash[1]"]),
    "no NICs": ('{"H100": {"nics_per_node": 0}}', ["nics_per_node"]),
    "unknown dtype": ('{"H100": {"peak_flops": {"bf17": "1T"}}}', ["'bf17'", "did you mean 'bf16'"]),
    "row not an object": ('{"H100": 5}', ["part 'H100'", "an object of fields"]),
    "a list": ('[1, 2]', ["expected a JSON object", "got list"]),
    "deep nesting": ('[' * 100_000, ["nested too deep"]),
    "huge number": ('{"H100": {"memory": 1e400}}', ["memory", "Infinity"]),
}


@pytest.mark.parametrize("name", list(HOSTILE_HARDWARE))
def test_a_hostile_hardware_file_is_one_line(name, tmp_path, monkeypatch):
    """Was: NaN in JSON output and a memory gate that passed, negative bandwidths in records,
    a 2.7e24 s step, misspelt keys dropped, 'xyz' registering x, y and z, tracebacks."""
    text, needles = HOSTILE_HARDWARE[name]
    path = tmp_path / "hw.json"
    path.write_text(text)
    monkeypatch.setenv("TORCHLEDGER_HARDWARE", str(path))
    r = run("estimate", "decode", "--params", "7B", "--gpu", "h100")
    err = one_line_error(r, f"TORCHLEDGER_HARDWARE={path}: ", *needles)
    assert r.stdout == "" and "Traceback" not in err


def test_a_hardware_fifo_or_device_is_refused(tmp_path, monkeypatch):
    fifo = tmp_path / "hw.fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a device")):
        monkeypatch.setenv("TORCHLEDGER_HARDWARE", str(path))
        one_line_error(run("estimate", "train", "--params", "7B", "--tokens", "1T"), kind)


def test_a_bad_hardware_file_stops_audit_before_nan_reaches_json(tmp_path, monkeypatch):
    """Was: exit 0 printing NaN (not JSON), TL-MEM-002 saying the step fits in nan B."""
    (tmp_path / "hw.json").write_text('{"H100": {"memory": NaN}}')
    monkeypatch.setenv("TORCHLEDGER_HARDWARE", str(tmp_path / "hw.json"))
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--gpu", "h100", "--format", "json", "--steps", "1")
    one_line_error(r, "TORCHLEDGER_HARDWARE=", "part 'H100': memory")
    assert r.stdout == ""


def test_a_failed_hardware_file_registers_nothing(tmp_path, monkeypatch):
    from torchledger.formulas.hardware import get_gpu
    (tmp_path / "hw.json").write_text('{"Z7": {"memory": "8GB", "bandwidth": "1TB/s", "peak_flops": '
                                      '{"bf16": "1T"}}, "H100": {"memory": -1}}')
    monkeypatch.setenv("TORCHLEDGER_HARDWARE", str(tmp_path / "hw.json"))
    with pytest.raises(ValueError, match="part 'H100': memory"):
        get_gpu("h100")
    monkeypatch.delenv("TORCHLEDGER_HARDWARE")
    with pytest.raises(ValueError, match="unknown GPU 'z7'"):
        get_gpu("z7")


def test_every_efficiency_parameter_is_checked_and_the_built_in_rows_pass():
    from torchledger.steptime.calibrate import FITTED
    from torchledger.formulas.hardware_fields import EFFICIENCY_FIELDS, check_row
    from torchledger.formulas.steptime import DEFAULT_EFFICIENCY, PART_EFFICIENCY
    assert set(EFFICIENCY_FIELDS) == set(DEFAULT_EFFICIENCY)
    check_row("default", {"efficiency": DEFAULT_EFFICIENCY})
    for name, row in PART_EFFICIENCY.items():
        check_row(name, {"efficiency": row})
    for key, (low, high) in FITTED.items():        # what calibrate writes is read back
        if key in EFFICIENCY_FIELDS:
            check_row("fitted", {"efficiency": {key: low}})
            check_row("fitted", {"efficiency": {key: high}})


def test_register_gpu_checks_its_arguments_too():
    from torchledger.formulas.hardware import register_gpu
    with pytest.raises(ValueError, match="part 'Z8': aliases"):
        register_gpu("Z8", "8GB", "1TB/s", {"bf16": "1T"}, aliases="xyz")
    with pytest.raises(ValueError, match="part 'Z8': bandwidth"):
        register_gpu("Z8", "8GB", float("nan"), {"bf16": "1T"})


# -- 3. --timeout: a number of seconds, and a short grace for exit handlers ---------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e10", "9.3e9", "1e400", "-1", "８"])
def test_timeout_nan_inf_or_huge_is_a_usage_error(value, tmp_path):
    """Was: a traceback (OverflowError, ValueError in select) with exit 1, CI's "findings"."""
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--steps", "1", "--timeout", value)
    one_line_error(r, "--timeout", "expected a number >= 0 and <= 1e+06", "0: no limit")


def test_exit_handlers_get_a_short_grace_not_the_whole_timeout(tmp_path):
    """Was: the audit waited the whole --timeout (30 min by default) for an exit handler that
    sleeps, after its report was in. Now: EXIT_GRACE_S, a warning, and the result's own code."""
    import time
    from torchledger.audit import supervise
    grace = getattr(supervise, "EXIT_GRACE_S", 3.0)
    path = write(tmp_path, "m.py", LINEAR + "    import atexit, time\n    atexit.register(lambda: time.sleep(600))\n")
    began = time.monotonic()
    r = run("audit", path, "--steps", "1", "--format", "json", "--timeout", "60", "--fail-on", "info")
    took = time.monotonic() - began
    data = json.loads(r.stdout)
    assert r.exit_code == (1 if data["findings"] else 0), r.stderr
    assert "exit handlers were still running" in r.stderr and "stopped them" in r.stderr
    assert grace <= took < grace + 30, took


# -- 9. digits that are not ASCII are not numbers in flags --------------------------------------
@pytest.mark.parametrize("args, flag", [
    (["--world-size", "８"], "--world-size"),           # full-width 8
    (["--world-size", "٨"], "--world-size"),            # Arabic-Indic 8
    (["--timing-steps", "３", "--device", "cpu"], "--timing-steps"),
    (["--mesh", "８x8"], "--mesh"),
    (["--mesh", "dp=٢,tp=4"], "--mesh"),
    (["--steps", "２"], "--steps"),
])
def test_non_ascii_digits_in_audit_flags_are_refused(args, flag, tmp_path):
    """Was: --world-size ８ ran 8 simulated ranks (int() reads full-width digits)."""
    r = run("audit", write(tmp_path, "m.py", LINEAR), *args)
    one_line_error(r, flag)


@pytest.mark.parametrize("args", [
    ["estimate", "params", "--preset", "gpt2", "--positions", "１０２４"],
    ["estimate", "train", "--params", "٧B", "--tokens", "1T"],
])
def test_non_ascii_digits_in_estimate_flags_are_refused(args):
    one_line_error(run(*args))


def test_snapshot_top_refuses_non_ascii_digits():
    r = run("snapshot", os.path.join(os.path.dirname(__file__), "data", "snapshots", "history.pickle"),
            "--top", "５")
    one_line_error(r, "--top")


# -- 4. report: a record the schema accepts renders ---------------------------------------------
@pytest.mark.parametrize("fmt", ["table", "markdown", "html", "json"])
def test_a_measured_step_with_no_ratio_renders(fmt, tmp_path):
    """Was: TypeError (format None with .2f) in table, markdown and html."""
    from _record_fuzz import SCENARIOS, load, with_predictions
    d = with_predictions(load(next(p for p in SCENARIOS if "cruncher-copy" in p)))
    d["predictions"]["step_time"].update(measured_seconds=0.0021, predicted_over_measured=None)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    r = run("report", str(path), "--format", fmt)
    assert r.exit_code == 0, r.output
    if fmt != "json":
        assert "predicted / measured -" in r.stdout


# -- 7. limits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--micro-batches", "1e12"), ("--micro-batches", "1000001"),
                                         ("--global-batch", "1e12")])
def test_absurd_micro_batches_are_refused_up_front(flag, value, tmp_path):
    """Was: exit 0 with FLOPs past int64 (a pipeline's), a record report refuses."""
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--steps", "1", flag, value)
    one_line_error(r, flag, "int64", repr(value))


def test_a_step_past_int64_is_one_line_not_a_record_report_refuses(tmp_path):
    """A fake step of 3 x 2**62 FLOPs: was exit 0 and a record `report` refused."""
    path = write(tmp_path, "m.py", """
        import torch, torchledger
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(2**20, 2**20, bias=False), torch.randn(2**21, 2**20))
    """)
    r = run("audit", path, "--steps", "1", "--format", "json")
    one_line_error(r, "past int64", "audit a smaller step")
    assert r.stdout == ""


def test_past_int64_names_the_first_count_outside():
    from torchledger.record.jsonio import past_int64
    assert past_int64({"totals": {"flops": {"total": 2**63 - 1}}, "x": [1.5e300, True]}) is None
    assert past_int64({"predictions": {"a": [{"b": 2**64}]}, "totals": {"flops": {"total": 2**63}}}) == \
        ("totals.flops.total", 2**63)                   # the total before its deeper parts


@pytest.mark.parametrize("gpu", ["", "   "])
def test_audit_refuses_an_empty_gpu(gpu, tmp_path):
    """Was: exit 0 with the memory gate (TL-MEM-002) silently off; estimate refused it."""
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--steps", "1", "--gpu", gpu)
    one_line_error(r, "--gpu", "expected a GPU name such as H100")


@pytest.mark.parametrize("change, needle", [
    ({"gpu": "A100 SXM"}, "the baseline was predicted on A100 SXM, this audit on H100 SXM"),
    ({"seconds": 0}, "the baseline's predicted step time is 0 s"),
])
def test_a_skipped_step_time_gate_says_so(change, needle, tmp_path):
    """Was: the --baseline step-time gate skipped without a word."""
    from _record_fuzz import SCENARIOS, load, with_predictions
    base = with_predictions(load(next(p for p in SCENARIOS if "cruncher-copy" in p)))
    base["predictions"]["step_time"].update(change)
    (tmp_path / "base.json").write_text(json.dumps(base))
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--steps", "1", "--gpu", "h100",
            "--baseline", str(tmp_path / "base.json"))
    assert r.exit_code in (0, 1), r.stderr
    assert f"torchledger: warning: --baseline: the predicted step time was not compared: {needle}" in r.stderr


def test_the_step_time_gate_still_compares_on_the_same_part(tmp_path):
    from torchledger.analyzers.steptime import compare_step_time, step_time_skipped
    from torchledger.record import StepRecord
    from _record_fuzz import SCENARIOS, load, with_predictions
    rec = StepRecord.from_dict(with_predictions(load(next(p for p in SCENARIOS if "cruncher-copy" in p))))
    base = StepRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    base.predictions["step_time"]["seconds"] /= 2
    assert step_time_skipped(rec, base) is None
    assert [f.rule for f in compare_step_time(rec, base)] == ["TL-BASELINE-001"]


LONG = "A" * 20_000


@pytest.mark.parametrize("args", [
    ["audit", "m.py", "--gpu", LONG], ["audit", "m.py", "--format", LONG], ["audit", "m.py", "--mesh", LONG],
    ["audit", "m.py", "--output", LONG + ".json"], ["audit", "m.py", "--baseline", LONG],
    ["audit", LONG + ".py"], ["report", LONG + ".json"], ["estimate", "decode", "--params", LONG],
])
def test_an_overlong_argument_is_not_echoed_whole(args, tmp_path):
    """Was: the 20,000 characters echoed back in the error line."""
    write(tmp_path, "m.py", LINEAR)
    r = run(*args, cwd=tmp_path)
    err = one_line_error(r)
    assert len(err) < 1000 and "characters)" in err, len(err)
