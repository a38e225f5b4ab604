"""``[tool.torchledger]`` settings from the nearest pyproject.toml, and budgets/baselines.

    [tool.torchledger]
    fail_on = "warning"          # error | warning | info | never
    max_params = "7B"            # budgets: a finding (error) when exceeded
    max_peak_bytes = "80GB"
    max_flops_per_token = 5e10
    min_mfu = 0.3                # also the low-MFU threshold
    tolerance = 0.05             # comparisons: unexplained gap that becomes a finding
    copy_share = 0.10            # copies: share of bytes moved that is reported
    cache_share = 0.01           # TL-MEM-001: a returned KV cache this share of the peak warns
    fp32_matmul_share = 0.01     # TL-PREC-001: fp32 matmul FLOPs under a 16-bit plan that warn
    baseline_tolerance = 0.01    # --baseline: growth that fails
    leak_min_bytes = 1024        # TL-LEAK-001 ignores slower growth than this per step
    ignore = ["TL-CMP-001"]      # audit: rules whose findings are suppressed (and counted)
    rank_peak_skew = 0.10        # report rank*.json: TL-RANK-001/002/003 thresholds
    rank_time_skew = 0.20
    rank_flops_skew = 0.05

Values are validated; a bad one is an error naming the key, what was expected and what
arrived.
"""
from __future__ import annotations

import math
import os

from . import units
from .record import Finding
from .rules import RULES

__all__ = ["SettingsError", "load_settings", "find_pyproject", "check_budgets", "compare_baseline",
           "SEVERITY_RANK", "known_rules", "rule_ids", "suppress"]

SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2, "never": 3}
_PARSERS = {
    "fail_on": ("one of error, warning, info, never", lambda v: _severity(v)),
    "max_params": ("a count such as 7B or 7e9", lambda v: _positive(units.parse_count(v))),
    "max_peak_bytes": ("a size such as 80GB or 80GiB", lambda v: _positive(units.parse_bytes(v))),
    "max_flops_per_token": ("a number such as 5e10", lambda v: _positive(units.parse_count(v))),
    "min_mfu": ("a fraction in (0, 1]", lambda v: _fraction(v)),
    "tolerance": ("a fraction such as 0.05", lambda v: _fraction(v)),
    "copy_share": ("a fraction such as 0.1", lambda v: _fraction(v)),
    "cache_share": ("a fraction such as 0.01", lambda v: _fraction(v)),
    "fp32_matmul_share": ("a fraction such as 0.01", lambda v: _fraction(v)),
    "baseline_tolerance": ("a fraction such as 0.01", lambda v: _fraction(v)),
    "leak_min_bytes": ("a size such as 1024 or 1KiB", lambda v: _positive(units.parse_bytes(v), zero=True)),
    "ignore": ('a list of rule ids such as ["TL-CMP-001"]', lambda v: _rule_list(v)),
    # report rank*.json (analyzers/ranks.py): how far above the median a rank may be
    "rank_peak_skew": ("a fraction such as 0.1", lambda v: _fraction(v)),
    "rank_time_skew": ("a fraction such as 0.2", lambda v: _fraction(v)),
    "rank_flops_skew": ("a fraction such as 0.05", lambda v: _fraction(v)),
}


def known_rules() -> list:
    """Every rule id a finding can carry: the catalogue's (:mod:`torchledger.rules`)."""
    return sorted(RULES)


def rule_ids(values, where: str) -> list:
    """``values`` as rule ids (case-insensitive: ``tl-cmp-001`` is ``TL-CMP-001``); one that
    names no rule is a ``SettingsError`` listing the valid ids."""
    valid = known_rules()
    out = []
    for v in values:
        rid = str(v).strip().upper()
        if rid not in valid:
            raise SettingsError(f"{where}: unknown rule id {v!r}; valid ids: {', '.join(valid)}")
        if rid not in out:
            out.append(rid)
    return out


def suppress(findings, ignore) -> tuple:
    """``(kept, suppressed)``: the findings of rules not in ``ignore``, and the others."""
    ignore = set(ignore or ())
    kept = [f for f in findings if f.rule not in ignore]
    return kept, [f for f in findings if f.rule in ignore]


class SettingsError(ValueError):
    """A malformed setting; the message is one line."""


def _severity(v) -> str:
    if v not in SEVERITY_RANK:
        raise ValueError
    return v


def _rule_list(v) -> list:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError
    return list(v)


def _fraction(v) -> float:
    if isinstance(v, bool):             # float(True) is 1.0: `min_mfu = true` is not a fraction
        raise ValueError
    x = float(v)
    if not 0 < x <= 1:
        raise ValueError
    return x


def _positive(x: float, zero: bool = False) -> float:
    """A budget of 0 or less (or NaN) would fail every audit, and one of ``inf`` (TOML's
    ``inf``) never: both refused as bad values."""
    if not (x >= 0 if zero else x > 0) or not math.isfinite(x):
        raise ValueError
    return x


def find_pyproject(start: str):
    """The nearest pyproject.toml at or above ``start`` (a file or folder), or None."""
    d = os.path.abspath(start if os.path.isdir(start) else os.path.dirname(os.path.abspath(start)))
    while True:
        p = os.path.join(d, "pyproject.toml")
        if os.path.isfile(p):
            return p
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def load_settings(start: str) -> dict:
    """Validated ``[tool.torchledger]`` of the nearest pyproject.toml ({} if none)."""
    path = find_pyproject(start)
    if path is None:
        return {}
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except Exception as e:
        raise SettingsError(f"{path}: not valid TOML ({e}); fix it or remove [tool.torchledger]") from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):        # `tool = 1`: TOML, but not the table tools read
        raise SettingsError(f"{path}: [tool] must be a table (tools' settings go under [tool.NAME]), "
                            f"got tool = {tool!r}; fix it or remove it")
    raw = tool.get("torchledger", {})
    if not isinstance(raw, dict):
        raise SettingsError(f"{path}: [tool.torchledger] must be a table, got {type(raw).__name__}")
    out = {}
    for key, value in raw.items():
        if key not in _PARSERS:
            raise SettingsError(f"{path}: [tool.torchledger] unknown key {key!r}; known keys: "
                                f"{', '.join(sorted(_PARSERS))}")
        expected, parse = _PARSERS[key]
        try:
            out[key] = parse(value)
        except (ValueError, TypeError):
            raise SettingsError(f"{path}: [tool.torchledger] {key}: expected {expected}, got {value!r}") from None
    if "ignore" in out:
        out["ignore"] = rule_ids(out["ignore"], f"{path}: [tool.torchledger] ignore")
    out["_source"] = path
    return out


def check_budgets(record, settings: dict) -> list:
    """TL-BUDGET-00x (error): a budget of ``settings`` exceeded by ``record``."""
    t = record.totals
    out = []
    checks = [
        ("max_params", t.get("params"), "TL-BUDGET-001", "parameters"),
        ("max_peak_bytes", t.get("peak_bytes"), "TL-BUDGET-002", "peak live bytes"),
        ("max_flops_per_token", t["flops"]["total"] / t["tokens"] if t.get("tokens") else None,
         "TL-BUDGET-003", "FLOPs per token"),
    ]
    for key, value, rule, what in checks:
        limit = settings.get(key)
        if limit is not None and value is not None and value > limit:
            out.append(Finding(rule, "error", f"{what} {value:,.0f} exceed the budget {key} = {limit:,.0f}",
                               measured=value, expected=limit,
                               hint=f"raise {key} in [tool.torchledger] if the growth is intended"))
    return out


def compare_baseline(record, baseline, tolerance: float = 0.01):
    """Findings (TL-BASELINE-001, error) and per-module rows for growth over ``baseline``."""
    t, b = record.totals, baseline.totals
    items = [("FLOPs", t["flops"]["total"], b["flops"]["total"]),
             ("peak bytes", t["peak_bytes"], b["peak_bytes"]),
             ("activation bytes", t["activation_bytes"], b["activation_bytes"]),
             ("params", t["params"], b["params"])]
    findings = []
    for what, now, before in items:
        if now > before and (not before or (now - before) / before > tolerance):
            grew = f"{100 * (now - before) / before:+.2f}%" if before else "from nothing"
            findings.append(Finding("TL-BASELINE-001", "error",
                                    f"{what} grew {grew} over the baseline "
                                    f"({before:,} -> {now:,}; tolerance {tolerance:.0%})",
                                    measured=now, expected=before,
                                    hint="update the baseline if the growth is intended"))
    old = {m.get("name"): m for m in baseline.modules}     # validated at load; older ones lack fields
    rows = []
    for m in record.modules:
        o = old.get(m.get("name"))
        if o is None:
            rows.append({"module": m.get("name"), "change": "new"})
            continue
        d_flops = _module_flops(m) - _module_flops(o)
        d_act = m.get("activation_bytes", 0) - o.get("activation_bytes", 0)
        if d_flops or d_act:
            rows.append({"module": m["name"], "flops_delta": d_flops, "activation_bytes_delta": d_act})
    names = {m.get("name") for m in record.modules}
    rows += [{"module": n, "change": "removed"} for n in old if n not in names]
    return findings, rows


def _module_flops(m: dict) -> int:
    return m.get("flops_forward", 0) + m.get("flops_backward", 0)
