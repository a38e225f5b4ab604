"""MFU and HFU: model FLOPs per second against the device's peak.

``mfu(record, peak_flops, seconds=None)`` = totals.flops.total / step time / peak;
HFU uses totals.hardware_flops (recomputation included). Step time is ``step_seconds`` of
the options (the median of untraced steps, which ``Ledger`` and ``audit`` time) or else the
median over the traced records after the first (warm-up), which includes the tracer's own
overhead. Fake and meta steps have no meaningful time and get no MFU.

A report prints one MFU: :func:`mfu_totals` decides it (value, and the steps its time comes
from, or why there is none) and the callers (``trace``, ``Ledger``, ``audit``) store it in
the record's totals (``mfu``, ``hfu``, ``mfu_source``), which the header prints and the
finding below quotes. Given the untraced steps' times (option ``untraced_seconds``), it also
says how many there were and how far apart (``step_timing``, :func:`timing_summary`): a
median of a few steps on a shared CPU can be off by a large factor, and the spread says so.

* TL-MFU-001 (warning): MFU below ``min_mfu`` (default 0.3, the floor of a healthy GPU run);
* TL-MFU-002 (warning): MFU above 1.0, a miscount or a wrong peak.
"""
from __future__ import annotations

import statistics

from ..record import Finding
from ..units import fmt_mfu

__all__ = ["step_seconds", "mfu", "check_mfu", "mfu_totals", "timing_summary"]


def step_seconds(records):
    """Median step time over the records after warm-up (all of them if there is only one)."""
    times = [r.totals.get("step_seconds") for r in records[1:] or records]
    times = [t for t in times if t]
    return statistics.median(times) if times else None


def mfu(record, peak_flops: float, seconds=None):
    """(MFU, HFU) of ``record`` at ``peak_flops`` FLOP/s; None when there is no time."""
    seconds = seconds if seconds is not None else record.totals.get("step_seconds")
    if not seconds or not peak_flops:
        return None, None
    t = record.totals
    return t["flops"]["total"] / seconds / peak_flops, t["hardware_flops"] / seconds / peak_flops


def timing_summary(seconds, warmup_steps: int = 0) -> dict:
    """How many untraced steps were timed, their median, extremes and spread:
    ``{"steps", "warmup_steps", "median_seconds", "min_seconds", "max_seconds", "spread"}``,
    ``spread`` = (max - min) / median (0.1: the slowest step took 10% of the median longer
    than the fastest). ``warmup_steps`` ran before them, untimed. The median of an even count
    is the upper middle value, as ``Ledger`` reads it.

        >>> round(timing_summary([0.010, 0.012, 0.011])["spread"], 4)     # (12 - 10) / 11 ms
        0.1818
    """
    times = sorted(float(t) for t in seconds)
    if not times:
        return {}
    median = times[len(times) // 2]
    return {"steps": len(times), "warmup_steps": warmup_steps, "median_seconds": median,
            "min_seconds": times[0], "max_seconds": times[-1],
            "spread": (times[-1] - times[0]) / median if median > 0 else 0.0}


def _ms(seconds: float) -> str:
    """``12.3 ms``, ``1.09 s`` (not ``1.09e+03 ms``)."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 0.9995 else f"{seconds:.3g} s"


def _summary_text(t: dict) -> str:
    """`` (min 11.9 ms, max 13.1 ms: spread 9.8%)`` after the median, for 2 steps or more."""
    if t.get("steps", 0) < 2:
        return ""
    return f" (min {_ms(t['min_seconds'])}, max {_ms(t['max_seconds'])}: spread {t['spread']:.1%})"


def _timing(records, opts):
    """``(seconds, where the time comes from)`` for the MFU of ``records``, or ``(None, why)``."""
    seconds = opts.get("step_seconds")
    if seconds:
        n = opts.get("untraced_steps")
        count = f"median of {n} untraced steps" if n else "untraced steps"
        summary = timing_summary(opts.get("untraced_seconds") or [], opts.get("warmup_steps", 0))
        warm = summary.get("warmup_steps")
        after = f" after {warm} untimed warm-up step{'s' if warm > 1 else ''}" if warm else ""
        return seconds, f"{count}{after}, {_ms(seconds)}{_summary_text(summary)}"
    seconds = step_seconds(records)
    if not seconds:
        return None, "no step time"
    n = len(records) - 1
    count = (f"median of {n} traced steps after the first" if n > 1 else
             "the traced step after the first" if n == 1 else "the traced step")
    return seconds, f"{count}, {seconds * 1e3:.3g} ms, tracer overhead included"


def mfu_totals(records, options=None) -> dict:
    """The one MFU of a report, as totals fields: ``{"mfu", "hfu", "mfu_source"}``.

    ``mfu_source`` says which steps the time comes from (``median of 4 untraced steps,
    12.3 ms``, or the traced steps, tracer overhead included) and the peak; when ``mfu`` is
    None it says why (no ``peak_flops`` given, a fake/meta device, no step time).
    """
    opts = options or {}
    none = {"mfu": None, "hfu": None}
    if not records:
        return dict(none, mfu_source="no step traced")
    rec = records[-1]
    if str(rec.meta.get("device", "")).startswith(("fake", "meta")):
        return dict(none, mfu_source=f"none on a {rec.meta.get('device')} device: no real step time "
                                     f"(run --device cpu or cuda to time the step)")
    peak = opts.get("peak_flops")
    if not peak:
        return _with_timing(dict(none, mfu_source="none: no peak FLOP/s given (peak_flops=, or "
                                                  "--peak-flops / --gpu)"), opts)
    seconds, where = _timing(records, opts)
    if seconds is None:
        return _with_timing(dict(none, mfu_source=f"none: {where}"), opts)
    m, h = mfu(rec, peak, seconds)
    out = {"mfu": m, "hfu": h,
           "mfu_source": f"{where}; peak {peak:.3g} FLOP/s ({opts.get('peak_source', 'given')})"}
    return _with_timing(out, opts)


def _with_timing(out: dict, opts: dict) -> dict:
    """``step_timing`` beside the MFU when untraced step times were given."""
    if opts.get("untraced_seconds"):
        out["step_timing"] = timing_summary(opts["untraced_seconds"], opts.get("warmup_steps", 0))
    return out


def check_mfu(records, options=None) -> list:
    opts = options or {}
    if records and _predicted(records[-1]) is not None and not _timed(records[-1]):
        return _check_predicted(records[-1], opts)
    if not records or not opts.get("peak_flops"):
        return []
    rec = records[-1]
    got = mfu_totals(records, opts)
    m, h = got["mfu"], got["hfu"]
    if m is None:
        return []
    where = f"{rec.meta.get('device')}, time from {got['mfu_source']}"
    floor = float(opts.get("min_mfu", 0.3))
    if m > 1.0:
        return [Finding("TL-MFU-002", "warning",
                        f"MFU {fmt_mfu(m)} is above 1 on {where}: a FLOP miscount or a wrong peak",
                        measured=m, expected=1.0, hint="check --peak-flops / --gpu and the dtype")]
    if m < floor:
        seconds, _ = _timing(records, opts)
        return [Finding("TL-MFU-001", "warning",
                        f"MFU {fmt_mfu(m)} (HFU {fmt_mfu(h)}) on {where}; step {seconds * 1e3:.1f} ms for "
                        f"{rec.totals['flops']['total']:,} FLOPs",
                        measured=m, expected=floor,
                        hint="small matrices, element-wise overhead or data loading; larger batch or "
                             "width, fused kernels, torch.compile")]
    return []


def _predicted(rec):
    p = (rec.predictions or {}).get("step_time")
    return p if isinstance(p, dict) and isinstance(p.get("mfu"), (int, float)) else None


def _timed(rec) -> bool:
    """A real step time to measure MFU with (not a fake or meta step)."""
    return bool(rec.totals.get("step_seconds")) and not str(rec.meta.get("device", "")).startswith(("fake", "meta"))


def _check_predicted(rec, opts) -> list:
    """TL-MFU-001/002 on the predicted MFU (``audit --gpu`` on fake tensors): CI sees a change
    that makes the step slower on the part before any GPU runs it."""
    p = _predicted(rec)
    m, h = p["mfu"], p.get("hfu")
    floor = float(opts.get("min_mfu", 0.3))
    where = f"predicted on {p.get('gpu')} ({p.get('seconds', 0) * 1e3:,.1f} ms per step)"
    if m > 1.0:
        return [Finding("TL-MFU-002", "warning", f"predicted MFU {fmt_mfu(m)} is above 1, {where}: a FLOP "
                        f"miscount", measured=m, expected=1.0)]
    if m < floor:
        return [Finding("TL-MFU-001", "warning",
                        f"predicted MFU {fmt_mfu(m)} (HFU {fmt_mfu(h) if h is not None else '-'}) {where}, below "
                        f"{fmt_mfu(floor)}: {p.get('bound', '')}",
                        measured=m, expected=floor,
                        hint="small matrices, element-wise overhead or exposed communication; larger batch or "
                             "width, fused kernels (--compiled / torch.compile), more overlap")]
    return []
