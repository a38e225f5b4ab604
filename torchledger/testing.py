"""Budgets for a traced step, written as assertions: ``assert_step(record, max_peak_bytes="2GB")``.

    import torchledger
    from torchledger.testing import assert_step

    def test_block_budget():
        with torchledger.trace(model, optimizer=opt, tokens=B * T) as t:
            model(x).loss.backward(); opt.step(); opt.zero_grad()
        assert_step(t, max_peak_bytes="2GB", max_flops_per_token=5e10, no_findings_at="warning")

On failure the ``AssertionError`` names every budget exceeded (measured, budget, by how
much) and shows the modules behind the quantity that broke it: the modules' own FLOPs,
activation bytes or parameters, largest first, the peak's breakdown by category, and the
findings at or above ``no_findings_at``. With ``baseline=`` it also fails on growth over a
saved record and lists each module's change. Pure Python over the record: torch is not
imported here.

Known limitations:

* Module figures are per ``named_modules()`` entry; a module's own share is its inclusive
  figure less its direct children's, so a storage shared between a parent and a child is
  counted once, under the child.
* ``no_findings_at`` sees the findings stored in the record (a ``trace()``'s default ones,
  or a ``Ledger``'s over its window) and those the single-record checks find again; checks
  that need several steps (leaks) only through the stored ones.
"""
from __future__ import annotations

import math
import os

from . import units
from .record import Finding, StepRecord, counts_samples
from .analyzers.checks import run_checks
from .inputs import RECORD_MAX_BYTES, read_input
from .record.schema import parse_record
from .settings import compare_baseline, rule_ids

__all__ = ["assert_step", "as_record"]

_SEVERITIES = ("info", "warning", "error")


def as_record(obj, what: str = "record") -> StepRecord:
    """A ``StepRecord`` from a record, a finished trace (anything with ``.record``), a record
    dict (``to_dict()`` shape) or the path of a record's JSON file."""
    if isinstance(obj, StepRecord):
        return obj
    if isinstance(obj, dict):
        return StepRecord.from_dict(obj)
    if isinstance(obj, (str, os.PathLike)):
        return StepRecord.from_dict(parse_record(read_input(obj, what="record JSON",
                                                            max_bytes=RECORD_MAX_BYTES)))
    if hasattr(obj, "record"):
        if obj.record is None:
            raise ValueError(f"{what}: the trace has no record yet; call assert_step after the "
                             f"`with torchledger.trace(...)` block ends")
        return as_record(obj.record, what)
    raise TypeError(f"{what}: expected a StepRecord, a finished trace, a record dict or the path of "
                    f"a record JSON file, got {type(obj).__name__}")


def _flops_budget(value):
    try:
        return units.parse_count(value)
    except ValueError:
        try:
            return units.parse_flops(value)
        except ValueError:
            raise ValueError(f"expected a FLOP count such as 5e10, 7B, 1.5T or 2GFLOP, "
                             f"got {value!r}") from None


def _bytes_budget(value):
    return units.parse_bytes(value)


def _count_budget(value):
    return units.parse_count(value, what="a count")


def _flops_per_token(t):
    return t["flops"]["total"] / t["tokens"] if t.get("tokens") else None


#: keyword -> (what is measured, parser, measure(totals), unit, module table)
_BUDGETS = {
    "max_peak_bytes": ("peak bytes", _bytes_budget, lambda t: t.get("peak_bytes"), "bytes", "memory"),
    "max_activation_bytes": ("activation bytes", _bytes_budget, lambda t: t.get("activation_bytes"),
                             "bytes", "activations"),
    "max_param_bytes": ("parameter bytes", _bytes_budget, lambda t: t.get("param_bytes"), "bytes",
                        "params"),
    "max_params": ("parameters", _count_budget, lambda t: t.get("params"), "count", "params"),
    "max_flops": ("FLOPs (forward + backward + optimizer)", _flops_budget,
                  lambda t: t["flops"]["total"], "count", "flops"),
    "max_flops_per_token": ("FLOPs per token", _flops_budget, _flops_per_token, "count", "flops"),
}


def _parse_budget(key, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{key}: expected a number or a string such as '2GB' or '7e9', "
                        f"got {type(value).__name__}")
    try:
        parsed = _BUDGETS[key][1](value)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    if not (math.isfinite(parsed) and parsed > 0):
        raise ValueError(f"{key}: expected a finite, positive budget, got {value!r}")
    return parsed


def _severity(value):
    if value is None or value == "never":
        return None
    if value not in _SEVERITIES:
        raise ValueError(f"no_findings_at: expected one of error, warning, info or None, got {value!r}")
    return _SEVERITIES.index(value)


def assert_step(record, max_peak_bytes=None, max_flops_per_token=None, no_findings_at=None, *,
                max_flops=None, max_activation_bytes=None, max_param_bytes=None, max_params=None,
                baseline=None, tolerance: float = 0.01, ignore=(), top: int = 5) -> StepRecord:
    """Fail (``AssertionError``) when the traced step breaks a budget; return its record.

    ``record``: a ``StepRecord``, a finished trace (``t`` or ``t.record``), a record dict or a
    record JSON path. Budgets take ints, floats or strings (``"2GB"``, ``"1.5GiB"``, ``"7e9"``,
    ``"1.5T"``); a measured value equal to its budget passes. ``no_findings_at`` ("error",
    "warning" or "info") fails on any finding at or above that severity, except rules listed
    in ``ignore``. ``baseline`` (same kinds as ``record``) fails when FLOPs, peak bytes,
    activation bytes or params grew more than ``tolerance`` over it. ``top``: modules listed
    per table. Bad arguments raise ``ValueError`` or ``TypeError``.
    """
    __tracebackhide__ = True            # pytest shows the caller's line, not this function's
    given = {"max_peak_bytes": max_peak_bytes, "max_flops_per_token": max_flops_per_token,
             "max_flops": max_flops, "max_activation_bytes": max_activation_bytes,
             "max_param_bytes": max_param_bytes, "max_params": max_params}
    budgets = {k: _parse_budget(k, v) for k, v in given.items() if v is not None}
    level = _severity(no_findings_at)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: expected an int >= 1 (modules listed per table), got {top!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"tolerance: expected a fraction >= 0 such as 0.01, got {tolerance!r}")
    if isinstance(ignore, str):
        ignore = [ignore]
    if ignore:
        ignore = rule_ids(ignore, "ignore")
    rec = as_record(record)
    base = as_record(baseline, "baseline") if baseline is not None else None
    t = rec.totals

    over, tables = [], []
    for key, budget in budgets.items():
        what, _, measure, unit, table = _BUDGETS[key]
        value = measure(t)
        if value is None:
            raise ValueError(f"{key}: the record has no tokens, so no FLOPs per token; pass tokens= "
                             f"to torchledger.trace")
        if key == "max_flops_per_token" and counts_samples(t):
            what = "FLOPs per sample"
        if value > budget:
            over.append(f"{what}: {_fmt(value, unit)} > {key} {_fmt(budget, unit)}, over by "
                        f"{_fmt(value - budget, unit)} ({100 * (value - budget) / budget:+.1f}%)")
            if table not in tables:
                tables.append(table)

    growth, rows = [], []
    if base is not None:
        growth, rows = compare_baseline(rec, base, tolerance)

    found = []
    if level is not None:
        found = [f for f in _findings(rec) if _SEVERITIES.index(f.severity) >= level
                 and f.rule not in ignore]

    if not (over or growth or found):
        return rec
    lines = [f"torchledger: the step of {_describe(rec)} is over budget"]
    lines += [f"  {line}" for line in over]
    lines += [f"  baseline: {f.message}" for f in growth]
    if found:
        lines.append(f"  {len(found)} finding(s) at or above {no_findings_at!r}:")
        lines += [f"    {_finding_line(f)}" for f in found]
    if rows:
        lines += ["", *_baseline_table(rows, top)]
    if "memory" in tables and "activations" in tables:      # the peak's table lists them already
        tables.remove("activations")
    for table in tables:
        lines += ["", *_TABLES[table](rec, top)]
    raise AssertionError("\n".join(lines))


def _findings(rec) -> list:
    """The record's stored findings and those the checks find again in it, each once."""
    out, seen = [], set()
    stored = [f if isinstance(f, Finding) else Finding.from_dict(f) for f in rec.findings]
    for f in stored + run_checks([rec], {}):
        key = (f.rule, f.severity, f.message, f.module)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return sorted(out, key=lambda f: -_SEVERITIES.index(f.severity))


def _finding_line(f) -> str:
    where = "".join(f" [{x}]" for x in (f.module and f"module {f.module}", f.location) if x)
    return f"{f.severity} {f.rule}{where}: {f.message}"


def _describe(rec) -> str:
    m, t = rec.meta, rec.totals
    parts = [str(m.get("model") or m.get("model_class") or "the model")]
    device = " ".join(str(x) for x in (m.get("device"), m.get("dtype")) if x)
    if device:
        parts.append(f"on {device}")
    if t.get("tokens"):
        parts.append(f"({t['tokens']:,} {'samples' if counts_samples(t) else 'tokens'})")
    return " ".join(parts)


def _fmt(n, unit: str) -> str:
    exact = f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"
    if unit == "bytes":
        return f"{exact} B" if abs(n) < 1000 else f"{exact} B = {units.fmt_bytes(n)}"
    return exact if abs(n) < 10_000 else f"{exact} ({units.fmt_count(n)})"


# -- per-module tables ------------------------------------------------------------------------
def _own(rec, value) -> list:
    """``(module, own, inclusive)`` per module: own = inclusive less the direct children's."""
    mods = rec.modules
    children: dict = {}
    for m in mods:
        name = m.get("name", "")
        if name:
            children.setdefault(name.rpartition(".")[0], []).append(m)
    return [(m, max(0, value(m) - sum(value(c) for c in children.get(m.get("name", ""), []))), value(m))
            for m in mods]


def _module_table(rec, top, title, value, fmt, total) -> list:
    rows = sorted((r for r in _own(rec, value) if r[1] > 0), key=lambda r: -r[1])
    if not rows:
        return [f"{title}: no module recorded any"]
    from tabulate import tabulate
    body = [[m.get("name") or "(root)", m.get("type", ""), fmt(own),
             f"{100 * own / total:.1f}%" if total else "-", fmt(incl)] for m, own, incl in rows[:top]]
    shown = f"top {min(top, len(rows))} of {len(rows)}"
    return [f"{title} ({shown}; own = the module less its children):",
            tabulate(body, headers=["module", "type", "own", "share", "with children"],
                     disable_numparse=True)]


def _flops_table(rec, top) -> list:
    def flops(m):
        return m.get("flops_forward", 0) + m.get("flops_backward", 0)
    f = rec.totals["flops"]
    return _module_table(rec, top, "FLOPs by module (forward + backward)", flops,
                         lambda n: f"{n:,}", f["forward"] + f["backward"])


def _activation_table(rec, top) -> list:
    return _module_table(rec, top, "activation bytes by module (saved for backward)",
                         lambda m: m.get("activation_bytes", 0), units.fmt_bytes,
                         rec.totals.get("activation_bytes", 0))


def _memory_table(rec, top) -> list:
    t, mem = rec.totals, rec.memory
    head = f"peak {units.fmt_bytes(t.get('peak_bytes', 0))}"
    if t.get("peak_phase"):
        head += f" in {t['peak_phase']}"
    if t.get("peak_module") is not None:
        head += f" (module {t['peak_module'] or '(root)'})"
    parts = [f"{k.replace('_', ' ')} {units.fmt_bytes(v)}"
             for k, v in (mem.get("peak_breakdown") or {}).items() if v]
    return [head + (": " + ", ".join(parts) if parts else ""), *_activation_table(rec, top)]


def _params_table(rec, top) -> list:
    return _module_table(rec, top, "parameters by module", lambda m: m.get("params", 0),
                         lambda n: f"{n:,}", rec.totals.get("params", 0))


_TABLES = {"flops": _flops_table, "activations": _activation_table, "memory": _memory_table,
           "params": _params_table}


def _baseline_table(rows, top) -> list:
    from tabulate import tabulate

    def size(r):
        return abs(r.get("flops_delta", 0)) + abs(r.get("activation_bytes_delta", 0))
    changed = sorted(rows, key=lambda r: (r.get("change") is None, -size(r)))[:top]
    body = [[r["module"] or "(root)", r.get("change") or "changed",
             f"{r['flops_delta']:+,}" if "flops_delta" in r else "-",
             f"{r['activation_bytes_delta']:+,}" if "activation_bytes_delta" in r else "-"]
            for r in changed]
    return [f"what changed against the baseline (top {len(body)} of {len(rows)} modules):",
            tabulate(body, headers=["module", "change", "FLOPs", "activation bytes"],
                     disable_numparse=True)]
