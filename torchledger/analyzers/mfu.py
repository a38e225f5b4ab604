"""MFU and HFU: model FLOPs per second against the device's peak.

``mfu(record, peak_flops, seconds=None)`` = totals.flops.total / step time / peak;
HFU uses totals.hardware_flops (recomputation included). Step time is ``step_seconds`` of
the options (the median of untraced steps, which ``Ledger`` and ``audit`` time) or else the
median over the traced records after the first (warm-up), which includes the tracer's own
overhead. Fake and meta steps have no meaningful time and get no MFU.

* TL-MFU-001 (warning): MFU below ``min_mfu`` (default 0.3, the floor of a healthy GPU run);
* TL-MFU-002 (warning): MFU above 1.0, a miscount or a wrong peak.
"""
from __future__ import annotations

import statistics

from ..record import Finding

__all__ = ["step_seconds", "mfu", "check_mfu"]


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


def check_mfu(records, options=None) -> list:
    opts = options or {}
    peak = opts.get("peak_flops")
    if not records or not peak:
        return []
    rec = records[-1]
    if str(rec.meta.get("device", "")).startswith(("fake", "meta")):
        return []
    seconds = opts.get("step_seconds")
    timed = "untraced steps" if seconds else "traced steps, tracer overhead included"
    seconds = seconds or step_seconds(records)
    m, h = mfu(rec, peak, seconds)
    if m is None:
        return []
    where = (f"{rec.meta.get('device')} at a peak of {peak:.3g} FLOP/s ({opts.get('peak_source', 'given')}; "
             f"time from {timed})")
    floor = float(opts.get("min_mfu", 0.3))
    if m > 1.0:
        return [Finding("TL-MFU-002", "warning",
                        f"MFU {m:.3f} is above 1 on {where}: a FLOP miscount or a wrong peak",
                        measured=m, expected=1.0, hint="check --peak-flops / --gpu and the dtype")]
    if m < floor:
        return [Finding("TL-MFU-001", "warning",
                        f"MFU {m:.4f} (HFU {h:.4f}) on {where}; step {seconds * 1e3:.1f} ms for "
                        f"{rec.totals['flops']['total']:,} FLOPs",
                        measured=m, expected=floor,
                        hint="small matrices, element-wise overhead or data loading; larger batch or "
                             "width, fused kernels, torch.compile")]
    return []
