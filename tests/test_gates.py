"""The CI gates of settings.py: each budget reads its own quantity, the baseline gate compares
relative growth against ``baseline_tolerance``, and every ``[tool.torchledger]`` key parses
(good values to the exact number, bad ones to one line and exit 2 through the CLI)."""
from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.record import StepRecord
from torchledger.settings import SettingsError, check_budgets, compare_baseline, load_settings


def record(params=1_000_000, peak=2_000_000, act=3_000_000, flops=4_000_000, tokens=100):
    """A record whose four gated quantities are all different, so a gate reading the wrong
    one gives a different verdict."""
    rec = StepRecord()
    t = rec.totals
    t["params"], t["peak_bytes"], t["activation_bytes"], t["tokens"] = params, peak, act, tokens
    t["flops"] = {**t["flops"], "total": flops}
    return rec


# -- budgets: each on its own quantity ----------------------------------------------------
# record(): params 1e6, peak 2e6 bytes, activation bytes 3e6, FLOPs/token 4e6/100 = 4e4
@pytest.mark.parametrize("settings, fired", [
    ({"max_params": 999_999}, ["TL-BUDGET-001"]),
    ({"max_params": 1_000_000}, []),                            # at the budget: not over it
    ({"max_params": 1_500_000}, []),                            # under peak/act/flops, over params
    ({"max_peak_bytes": 1_999_999}, ["TL-BUDGET-002"]),
    ({"max_peak_bytes": 2_000_000}, []),
    ({"max_peak_bytes": 2_500_000}, []),      # below activation bytes (3e6): the peak is what counts
    ({"max_flops_per_token": 39_999}, ["TL-BUDGET-003"]),
    ({"max_flops_per_token": 40_000}, []),
    ({"max_flops_per_token": 999_999}, []),   # above FLOPs/token, below params and total FLOPs
    ({"max_params": 10**9, "max_peak_bytes": 10**9, "max_flops_per_token": 10**9}, []),
])
def test_each_budget_reads_its_own_quantity(settings, fired):
    found = check_budgets(record(), settings)
    assert [f.rule for f in found] == fired
    for f in found:
        assert f.severity == "error"


def test_budget_findings_name_the_measured_value():
    (params,) = check_budgets(record(), {"max_params": 999_999})
    assert (params.measured, params.expected) == (1_000_000, 999_999)
    (peak,) = check_budgets(record(), {"max_peak_bytes": 1_999_999})
    assert (peak.measured, peak.expected) == (2_000_000, 1_999_999)
    (fpt,) = check_budgets(record(), {"max_flops_per_token": 39_999})
    assert fpt.measured == 40_000                               # 4,000,000 FLOPs / 100 tokens
    assert "40,000" in fpt.message and "max_flops_per_token" in fpt.message


def test_peak_budget_fires_on_the_peak_not_the_activations():
    # peak above the budget, activation bytes below it: the reverse of the record above
    found = check_budgets(record(peak=5_000_000, act=1_000), {"max_peak_bytes": 4_000_000})
    assert [f.measured for f in found] == [5_000_000]


def test_flops_per_token_budget_needs_tokens():
    assert check_budgets(record(tokens=0), {"max_flops_per_token": 1}) == []


# -- the baseline gate: relative growth --------------------------------------------------
QUANTITIES = {"FLOPs": "flops", "peak bytes": "peak", "activation bytes": "act", "params": "params"}
BEFORE = 1_000_000


@pytest.mark.parametrize("what", QUANTITIES)
@pytest.mark.parametrize("now, fails", [
    (1_009_999, False),         # +0.9999% < 1%
    (1_010_000, False),         # +1.0000%: at the tolerance, not over it
    (1_010_001, True),          # +1.0001% > 1%
    (1_500_000, True),          # +50%
    (999_000, False),           # -0.1%: shrinkage passes
    (1, False),                 # -99.9999%
])
def test_baseline_tolerance_is_relative_growth(what, now, fails):
    base = record(**{v: BEFORE for v in QUANTITIES.values()})
    rec = record(**{v: BEFORE for v in QUANTITIES.values()} | {QUANTITIES[what]: now})
    findings, _ = compare_baseline(rec, base, 0.01)
    assert [f.rule for f in findings] == (["TL-BASELINE-001"] if fails else [])
    if fails:
        assert findings[0].message.startswith(f"{what} grew")
        assert (findings[0].measured, findings[0].expected) == (now, BEFORE)


def test_baseline_tolerance_from_the_setting_scales_the_threshold():
    base = record(flops=BEFORE)
    rec = record(flops=1_049_999)                       # +4.9999%
    assert compare_baseline(rec, base, 0.05)[0] == []
    assert [f.rule for f in compare_baseline(rec, base, 0.01)[0]] == ["TL-BASELINE-001"]
    assert [f.rule for f in compare_baseline(record(flops=1_050_001), base, 0.05)[0]] == ["TL-BASELINE-001"]


def test_baseline_small_absolute_growth_of_a_large_quantity_passes():
    # 0.5% of 1e12 is 5e9 bytes: absolute growth is huge, relative growth is under 1%
    base = record(peak=10**12)
    rec = record(peak=10**12 + 5 * 10**9)
    assert compare_baseline(rec, base, 0.01)[0] == []


def test_baseline_zero_before_never_divides():
    # growth from nothing is growth (no division by the zero baseline); nothing to nothing passes
    (f,) = compare_baseline(record(params=10), record(params=0), 0.01)[0]
    assert (f.rule, f.measured, f.expected) == ("TL-BASELINE-001", 10, 0)
    assert "grew from nothing" in f.message
    assert compare_baseline(record(params=0), record(params=0), 0.01)[0] == []


# -- [tool.torchledger] parsing -------------------------------------------------------------
def settings_from(tmp_path, body: str) -> dict:
    (tmp_path / "pyproject.toml").write_text("[tool.torchledger]\n" + textwrap.dedent(body))
    return load_settings(str(tmp_path))


def test_every_key_parses_to_its_value(tmp_path):
    s = settings_from(tmp_path, """
        fail_on = "warning"
        max_params = "7B"
        max_peak_bytes = "80GiB"
        max_flops_per_token = 5e10
        min_mfu = 0.3
        tolerance = 0.05
        copy_share = 0.1
        cache_share = 0.01
        baseline_tolerance = 1
        leak_min_bytes = "4KiB"
    """)
    assert s.pop("_source") == str(tmp_path / "pyproject.toml")
    assert s == {"fail_on": "warning", "max_params": 7_000_000_000, "max_peak_bytes": 80 * 2**30,
                 "max_flops_per_token": 5e10, "min_mfu": 0.3, "tolerance": 0.05, "copy_share": 0.1,
                 "cache_share": 0.01, "baseline_tolerance": 1.0, "leak_min_bytes": 4096}


@pytest.mark.parametrize("level", ["error", "warning", "info", "never"])
def test_fail_on_levels(tmp_path, level):
    assert settings_from(tmp_path, f'fail_on = "{level}"\n')["fail_on"] == level


FRACTIONS = ["min_mfu", "tolerance", "copy_share", "cache_share", "baseline_tolerance"]


@pytest.mark.parametrize("key", FRACTIONS)
@pytest.mark.parametrize("value, parsed", [("1e-9", 1e-9), ("0.5", 0.5), ("1", 1.0), ('"0.25"', 0.25)])
def test_fractions_in_range(tmp_path, key, value, parsed):
    assert settings_from(tmp_path, f"{key} = {value}\n")[key] == parsed


BAD = [("fail_on", '"warn"'), ("fail_on", '"ERROR"'), ("fail_on", "1"),
       ("max_params", '"lots"'), ("max_peak_bytes", '"80 parsecs"'), ("max_flops_per_token", "[1]"),
       ("leak_min_bytes", '"big"'), ("leak_min_bytes", "-1"),
       # a budget of 0 or less would fail every audit: a bad value, not a gate
       ("max_params", "0"), ("max_params", '"-7B"'), ("max_peak_bytes", "-1"), ("max_peak_bytes", "nan"),
       ("max_flops_per_token", "0")]
BAD += [(k, v) for k in FRACTIONS for v in ("0", "-0.1", "1.5", '"half"', "true", "nan")]


@pytest.mark.parametrize("key, value", BAD)
def test_bad_values_name_the_key_and_what_was_expected(tmp_path, key, value):
    with pytest.raises(SettingsError) as e:
        settings_from(tmp_path, f"{key} = {value}\n")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"[tool.torchledger] {key}: expected " in msg and "got " in msg


@pytest.mark.parametrize("key, value", BAD + [("no_such_key", "1")])
def test_bad_values_exit_2_through_the_cli(tmp_path, key, value):
    (tmp_path / "pyproject.toml").write_text(f"[tool.torchledger]\n{key} = {value}\n")
    model = tmp_path / "m.py"
    model.write_text("raise SystemExit('the audit must not run with bad settings')\n")
    r = CliRunner().invoke(cli, ["audit", str(model)], catch_exceptions=False)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output
    assert key in err and str(tmp_path / "pyproject.toml") in err


def test_leak_min_bytes_may_be_zero(tmp_path):
    assert settings_from(tmp_path, "leak_min_bytes = 0\n")["leak_min_bytes"] == 0


def test_not_a_table_and_not_toml(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool]\ntorchledger = 3\n')
    with pytest.raises(SettingsError, match="must be a table, got int"):
        load_settings(str(tmp_path))
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger\n')
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(str(tmp_path))


def test_no_pyproject_no_settings(tmp_path, monkeypatch):
    import torchledger.settings as settings
    monkeypatch.setattr(settings, "find_pyproject", lambda start: None)
    assert load_settings(str(tmp_path)) == {}


def test_nearest_pyproject_wins(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nfail_on = "info"\n')
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    assert load_settings(str(inner))["fail_on"] == "info"
    (tmp_path / "a" / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert load_settings(str(inner / "m.py")) == {"_source": str(tmp_path / "a" / "pyproject.toml")}


def test_baseline_compares_each_quantity_with_its_own_baseline():
    # baseline quantities all different: params 1e6, peak 2e6, activation bytes 3e6, FLOPs 4e6
    base = record()
    grown = {"params": 1_020_000, "peak": 2_040_000, "act": 3_060_000, "flops": 4_080_000}   # +2% each
    for key, value in grown.items():
        (f,) = compare_baseline(record(**{key: value}), base, 0.01)[0]
        assert (f.measured, f.expected) == (value, {"params": 1_000_000, "peak": 2_000_000,
                                                    "act": 3_000_000, "flops": 4_000_000}[key])
        assert "+2.00%" in f.message
    under = {"params": 1_005_000, "peak": 2_010_000, "act": 3_015_000, "flops": 4_020_000}   # +0.5% each
    assert compare_baseline(record(**under), base, 0.01)[0] == []


def test_baseline_module_rows():
    base, now = record(), record()
    base.modules = [{"name": "", "flops_forward": 10, "flops_backward": 20, "activation_bytes": 100},
                    {"name": "a", "flops_forward": 4, "flops_backward": 8, "activation_bytes": 40},
                    {"name": "gone", "flops_forward": 1, "flops_backward": 2, "activation_bytes": 3}]
    now.modules = [{"name": "", "flops_forward": 10, "flops_backward": 20, "activation_bytes": 164},
                   {"name": "a", "flops_forward": 6, "flops_backward": 12, "activation_bytes": 40},
                   {"name": "new", "flops_forward": 1, "flops_backward": 2, "activation_bytes": 64}]
    assert compare_baseline(now, base, 0.01)[1] == [
        {"module": "", "flops_delta": 0, "activation_bytes_delta": 64},     # 164 - 100
        {"module": "a", "flops_delta": 6, "activation_bytes_delta": 0},     # (6 + 12) - (4 + 8)
        {"module": "new", "change": "new"},
        {"module": "gone", "change": "removed"}]
    assert compare_baseline(base, base, 0.01)[1] == []                      # unchanged: no rows


def test_find_pyproject_walks_up_to_the_root_and_stops(tmp_path, monkeypatch):
    from torchledger import settings
    looked = []

    def isfile(p):
        looked.append(p)
        return False
    monkeypatch.setattr(settings.os.path, "isfile", isfile)
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert settings.find_pyproject(str(deep)) is None
    assert looked[0] == str(deep / "pyproject.toml") and looked[-1] == "/pyproject.toml"
    assert len(looked) == len(deep.parts)              # every folder from deep up to / once
