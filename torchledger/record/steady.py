"""What a steady step holds, read from a record of a first one: the optimizer state that step
made from none (``first_step_state``) and the peak a later step reaches with that state held
through its forward and backward (``steady_peak``). Read by the memory fit check and the time
model alike."""
from __future__ import annotations

__all__ = ["first_step_state", "steady_peak", "steady_peak_phase"]


def first_step_state(rec) -> int:
    """Bytes of optimizer state the step made from none (its first ``optimizer.step()``), else
    0: the record's memory timeline starts with no optimizer state and the optimizer holds
    some at the end."""
    state = int((getattr(rec, "optimizer", None) or {}).get("state_bytes") or 0)
    timeline = (getattr(rec, "memory", None) or {}).get("timeline") or []
    if not state or not timeline or "optimizer_state" not in timeline[0]:
        return 0
    return state if timeline[0]["optimizer_state"] == 0 else 0


def _phase_peaks(rec) -> dict:
    return (getattr(rec, "memory", None) or {}).get("phase_peaks") or {}


def steady_peak(rec, made: int) -> int:
    """The peak of a steady step, estimated from a first one: forward and backward peaks plus
    the ``made`` bytes of optimizer state they will hold, or the measured peak if higher."""
    peaks = _phase_peaks(rec)
    before = [peaks[p] + made for p in ("forward", "backward", "recompute") if p in peaks]
    return max([int(rec.totals.get("peak_bytes") or 0)] + before)


def steady_peak_phase(rec, made: int):
    peaks = _phase_peaks(rec)
    best = max(((peaks[p] + made, p) for p in ("forward", "backward", "recompute") if p in peaks), default=None)
    if best is None or best[0] <= int(rec.totals.get("peak_bytes") or 0):
        return rec.totals.get("peak_phase")
    return best[1]
