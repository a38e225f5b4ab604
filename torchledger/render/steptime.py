"""The "predicted step time" lines every report prints under its header (``audit --gpu``).

    >>> print("\\n".join(step_time_lines(record)))

A record without ``predictions.step_time`` prints nothing (its report is unchanged).
"""
from __future__ import annotations

from ..units import fmt_mfu

__all__ = ["step_time_lines", "fmt_seconds"]


def fmt_seconds(s) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.1f} ms"
    return f"{s * 1e6:,.0f} us"


def step_time_lines(record) -> list:
    p = (getattr(record, "predictions", None) or {}).get("step_time")
    if not isinstance(p, dict) or not isinstance(p.get("seconds"), (int, float)):
        return []
    m = p.get("micro_batches") or 1
    rate = p.get("tokens_per_s_per_gpu")
    head = (f"predicted step time on {p.get('gpu')}: {fmt_seconds(p['seconds'])}"
            f" ({m} micro-batch{'es' if m != 1 else ''}"
            f"{', compiled' if p.get('compiled') else ''})")
    if rate:
        head += f", {rate:,.0f} tokens/s per GPU"
    if p.get("mfu") is not None:
        head += f", MFU {fmt_mfu(p['mfu'])}"
        if p.get("hfu") is not None:
            head += f" (HFU {fmt_mfu(p['hfu'])})"
    lines = [head]
    phases = p.get("by_phase") or {}
    comm = p.get("comm_seconds") or 0
    text = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in phases.items() if v)
    text += f"; communication {fmt_seconds(comm)}, {fmt_seconds(p.get('comm_exposed_seconds') or 0)} exposed"
    if p.get("bubble_seconds"):
        text += f"; pipeline bubble {fmt_seconds(p['bubble_seconds'])}"
    lines.append(f"  time per phase: {text}")
    lines.append(f"  where the time goes: {p.get('bound', '-')}")
    if p.get("measured_seconds"):
        ratio = p.get("predicted_over_measured")      # null where the schema allows it
        lines.append(f"  measured {fmt_seconds(p['measured_seconds'])}: predicted / measured "
                     f"{f'{ratio:.2f}' if isinstance(ratio, (int, float)) else '-'}")
    if p.get("assumptions"):
        lines.append("  assumes: " + "; ".join(p["assumptions"]))
    return lines
