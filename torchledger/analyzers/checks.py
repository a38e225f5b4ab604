"""Checks over step records: ``check_x(records, options) -> list[Finding]``.

Every check is a pure function over plain records, so it also runs offline on a record
loaded from JSON. ``ALL_CHECKS`` lists them; ``run_checks`` runs them all.
"""
from __future__ import annotations

from ..record import Finding

__all__ = ["ALL_CHECKS", "run_checks", "check_uncounted_ops", "check_fake_kernel_gaps",
           "check_tracer_warnings", "FAKE_KERNEL_GAPS"]


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


#: Ops whose fake/meta kernel (``torch._meta_registrations``) returns an empty buffer where
#: the real kernel returns one that autograd saves for backward: on fake or meta tensors the
#: activation and peak bytes leave that buffer out.
FAKE_KERNEL_GAPS = {
    "mkldnn_rnn_layer": "oneDNN's RNN workspace",
    "_cudnn_rnn": "cuDNN's RNN reserve space",
    "miopen_rnn": "MIOpen's RNN reserve space",
}


def check_fake_kernel_gaps(records, options=None) -> list:
    """TL-FAKE-001 (warning): a fake/meta step ran an op whose fake kernel under-reports what
    the real kernel keeps for backward, so activation and peak bytes are low."""
    if not records:
        return []
    rec = records[-1]
    device = str(rec.meta.get("device") or "")
    if not (device == "meta" or device.startswith("fake")):
        return []
    seen: dict = {}
    for o in rec.ops:
        name = str(o.get("op", "")).split(".")
        if len(name) >= 2 and name[1] in FAKE_KERNEL_GAPS and o.get("phase") == "forward":
            first = seen.setdefault(name[1], [0, o.get("module")])
            first[0] += o.get("count", 0)
    return [Finding("TL-FAKE-001", "warning",
                    f"on {device} tensors aten.{op} (x{n}) returns an empty buffer where the real "
                    f"kernel keeps {FAKE_KERNEL_GAPS[op]} for backward: activation and peak bytes "
                    f"leave it out", module=module, measured=n,
                    hint="audit with --device cpu (or cuda) to measure it")
            for op, (n, module) in seen.items()]


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
    from .comm import check_comm_steps
    from .compare import check_comparisons
    from .copies import check_copies
    from .leaks import check_leaks
    from .fit import check_gpu_fit
    from .interconnect import check_comm_time
    from .mfu import check_mfu
    from .outputs import check_output_cache
    return [check_comparisons, check_copies, check_leaks, check_output_cache, check_gpu_fit,
            check_comm_time, check_mfu, check_allocator, check_uncounted_ops, check_fake_kernel_gaps,
            check_tracer_warnings, check_comm_steps]


ALL_CHECKS = _all()


def run_checks(records, options=None, checks=None) -> list:
    """Run every check (or ``checks``) over ``records``; findings sorted by severity."""
    order = {"error": 0, "warning": 1, "info": 2}
    out = []
    for check in checks or ALL_CHECKS:
        out.extend(check(list(records), options or {}))
    return sorted(out, key=lambda f: order[f.severity])
