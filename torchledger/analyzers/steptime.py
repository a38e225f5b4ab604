"""Checks on the predicted step time: the baseline gate (TL-BASELINE-001, and why it cannot
compare when it cannot) and the communication verdict (TL-NET-001). The prediction itself is
the time model's (:mod:`torchledger.steptime`); its names are re-exported here for callers of
the old path ``torchledger.analyzers.steptime``."""
from __future__ import annotations

import math

from ..record import Finding
from ..steptime.predict import (attach_step_time, causal_mask_assumptions, collective_row_seconds,  # noqa: F401
                                op_seconds, predict_into, predict_step_time)
from ..units import fmt_bytes, fmt_ms

__all__ = ["compare_step_time", "step_time_skipped", "comm_finding",
           # the time model's, re-exported (old import path)
           "predict_step_time", "attach_step_time", "op_seconds", "causal_mask_assumptions",
           "collective_row_seconds", "predict_into"]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare_step_time(record, baseline, tolerance: float = 0.01) -> list:
    """TL-BASELINE-001 when the predicted step time grew more than ``tolerance`` over a
    baseline predicted on the same part (records without a prediction compare nothing)."""
    if step_time_skipped(record, baseline) is not None:
        return []
    now = (record.predictions or {}).get("step_time") or {}
    before = (baseline.predictions or {}).get("step_time") or {}
    a, b = now.get("seconds"), before.get("seconds")
    if not (_finite(a) and _finite(b)):                 # neither predicted: nothing to gate
        return []
    if (a - b) / b > tolerance:
        return [Finding("TL-BASELINE-001", "error",
                        f"predicted step time on {now.get('gpu')} grew {100 * (a - b) / b:+.2f}% over the "
                        f"baseline ({b * 1e3:,.2f} ms -> {a * 1e3:,.2f} ms; tolerance {tolerance:.0%})",
                        measured=a, expected=b, hint="update the baseline if the slowdown is intended")]
    return []


def step_time_skipped(record, baseline):
    """Why :func:`compare_step_time` cannot compare this audit's predicted step time with the
    baseline's (one sentence, for a warning), or None: it compares them, or neither has one."""
    now = _step_time(record)
    before = _step_time(baseline)
    if not now and not before:
        return None
    if not before or not _finite(before.get("seconds")):
        return "the baseline has no predicted step time (audit it with --gpu)"
    if not now or not _finite(now.get("seconds")):
        return f"this audit has no predicted step time (the baseline's is on {before.get('gpu')}: give --gpu)"
    if now.get("gpu") != before.get("gpu"):
        return f"the baseline was predicted on {before.get('gpu')}, this audit on {now.get('gpu')}"
    if before["seconds"] <= 0:
        return f"the baseline's predicted step time is {before['seconds']:g} s; a gate against it would always fail"
    return None


def _step_time(record) -> dict:
    p = (getattr(record, "predictions", None) or {}).get("step_time")
    return p if isinstance(p, dict) else {}


def comm_finding(rec, pred: dict, bus_total: float, kind: str) -> list:
    """TL-NET-001 from the predicted step time: each collective on the link its group spans
    (NCCL's ring/tree alpha-beta, concurrent groups sharing a node's NICs), against the compute
    it overlaps. Warning when communication alone outlasts the compute (communication-bound
    even with full overlap); info otherwise."""
    rows = [c for c in rec.collectives or [] if isinstance(c, dict) and "predicted_seconds" in c]
    comm = float(pred.get("comm_seconds") or 0)
    exposed = float(pred.get("comm_exposed_seconds") or 0)
    compute = sum(v for k, v in (pred.get("by_kind") or {}).items() if k in ("matmul", "attention", "memory_bound",
                                                                           "launch"))
    by_op: dict = {}
    for c in rows:
        by_op[c.get("op")] = by_op.get(c.get("op"), 0.0) + c["predicted_seconds"]
    split = ", ".join(f"{op} {fmt_ms(s)}" for op, s in sorted(by_op.items(), key=lambda kv: -kv[1]))
    world, micro = rec.totals.get("world_size") or 1, int(pred.get("micro_batches") or 1)
    # with micro-batches the record's bytes and rows are one micro-batch's, the times the step's
    per = ("per step on each of {} ranks' links take" if micro == 1 else
           f"per micro-batch (the traced one of the step's {micro}) on each of {{}} ranks' links; the "
           f"step's collectives take").format(world)
    text = (f"{fmt_bytes(bus_total)} of {kind} {per} {fmt_ms(comm)} on {pred.get('gpu')} "
            f"({'' if micro == 1 else 'one micro-batch: '}{split or 'no rows'}; NCCL ring/tree on each group's "
            f"link, groups that run at once sharing a node's NICs); {fmt_ms(exposed)} of it is exposed after "
            f"overlap with {fmt_ms(compute)} of compute")
    if comm > compute > 0:
        return [Finding("TL-NET-001", "warning", text + " (communication-bound even with full overlap)",
                        measured=comm, expected=compute,
                        hint="more tokens per rank, a smaller data-parallel group (HSDP), or keep TP inside a node")]
    return [Finding("TL-NET-001", "info", text, measured=comm, expected=compute)]
