"""Checks over step records: ``check_x(records, options) -> list[Finding]``.

Every check is a pure function over plain records, so it also runs offline on a record
loaded from JSON. ``ALL_CHECKS`` lists them; ``run_checks`` runs them all.
"""
from __future__ import annotations

from ..record import Finding

__all__ = ["ALL_CHECKS", "run_checks", "check_uncounted_ops", "check_tracer_warnings"]


def check_uncounted_ops(records, options=None) -> list:
    """TL-FLOP-001 (info): ops with no FLOP formula, so totals may be low."""
    if not records:
        return []
    rec = records[-1]
    if not rec.uncounted_ops:
        return []
    names = ", ".join(f"{u['op']} x{u['count']}" for u in rec.uncounted_ops[:5])
    return [Finding("TL-FLOP-001", "info",
                    f"{len(rec.uncounted_ops)} op kind(s) have no FLOP formula and are not in the "
                    f"totals: {names}",
                    measured=sum(u["count"] for u in rec.uncounted_ops),
                    hint="if any of these does real arithmetic, the FLOP totals are a lower bound")]


def check_tracer_warnings(records, options=None) -> list:
    """TL-TRACE-001 (warning): the tracer could not record part of the step."""
    out = []
    for rec in records[-1:]:
        for w in rec.warnings[:3]:
            out.append(Finding("TL-TRACE-001", "warning", w))
    return out


def check_allocator(records, options=None) -> list:
    """TL-CUDA-001/002 from the CUDA allocator's snapshot of the last step (CUDA only)."""
    if not records:
        return []
    alloc = records[-1].memory.get("allocator") or {}
    if not alloc.get("available"):
        return []
    from .snapshot import check_snapshot
    return check_snapshot(alloc["summary"], options or {})


def _all():
    from .compare import check_comparisons
    from .copies import check_copies
    from .leaks import check_leaks
    from .fit import check_gpu_fit
    from .mfu import check_mfu
    from .outputs import check_output_cache
    return [check_comparisons, check_copies, check_leaks, check_output_cache, check_gpu_fit,
            check_mfu, check_allocator, check_uncounted_ops, check_tracer_warnings]


ALL_CHECKS = _all()


def run_checks(records, options=None, checks=None) -> list:
    """Run every check (or ``checks``) over ``records``; findings sorted by severity."""
    order = {"error": 0, "warning": 1, "info": 2}
    out = []
    for check in checks or ALL_CHECKS:
        out.extend(check(list(records), options or {}))
    return sorted(out, key=lambda f: order[f.severity])
