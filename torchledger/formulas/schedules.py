"""Pipeline schedules simulated: each rank's action list, built by the rules PyTorch's schedule
classes (``torch.distributed.pipelining.schedules``) build it with, and what the list implies:
the activations a rank holds at its peak and the bubble. Pure Python, no torch.

p pipeline ranks, v chunks (virtual stages) per rank, m micro-batches; chunk (stage) s lives on
rank s mod p (PyTorch's "loop" placement). An action is ``(stage, kind, micro_batch)`` with kind
``F`` (forward), ``B`` (full backward), ``I`` (backward for the input) or ``W`` (backward for
the weights, zero-bubble's split). The schedule names and the classes they follow:

============== =========================================== ==================================
name           PyTorch class                               refused (as PyTorch refuses)
============== =========================================== ==================================
1f1b, v = 1    ``Schedule1F1B``                            m < p
1f1b, v > 1    ``ScheduleInterleaved1F1B`` (as interleaved)
interleaved    ``ScheduleInterleaved1F1B``                 m not a multiple of max(1, m // p)
gpipe          ``ScheduleGPipe``; v > 1 ``ScheduleLoopedBFS``
zero-bubble    ``ScheduleInterleavedZeroBubble`` (ZB1P)    m not a multiple of max(1, m // p)
============== =========================================== ==================================

In flight: a forward adds one chunk-micro-batch of activations, a full backward frees it; under
zero-bubble the weight backward frees it (the inputs of the weights' matmuls stay saved until
then), so a rank holds its forwards minus its weight backwards. The bubble: the ranks run their
lists in order, an action starting when the rank is free and its input is there (the previous
stage's forward; the next stage's backward, or the loss for the last stage), with F, I and W one
unit of time and B two (Qi et al. 2023's equal-time assumption), sends free; the bubble is the
step's time over the ideal 3 v m, minus one.

    >>> simulate(4, 2, 6, "interleaved").in_flight
    (12, 11, 9, 7)
    >>> simulate(4, 1, 8, "1f1b").bubble_fraction
    0.375
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

__all__ = ["SCHEDULES", "Simulation", "schedule_problem", "rank_actions", "simulate", "held", "held_bytes",
           "step_time"]

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero-bubble")

#: Time units per action kind (forward, full backward, input backward, weight backward).
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


class Simulation(NamedTuple):
    """A schedule's figures: chunk-micro-batches in flight at each rank's peak, the bubble
    (idle over ideal time) and the step's time in units of one chunk's forward."""
    in_flight: tuple
    bubble_fraction: float
    time_units: int


def _check(p: int, v: int, m: int, schedule: str) -> None:
    for name, x in (("p", p), ("v", v), ("m", m)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {x!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def schedule_problem(p: int, v: int, m: int, schedule: str) -> Optional[str]:
    """Why PyTorch's schedule class refuses ``m`` micro-batches, in one sentence; None if it
    takes them."""
    _check(p, v, m, schedule)
    if schedule == "1f1b" and v == 1 and m < p:
        return (f"PyTorch's Schedule1F1B refuses fewer micro-batches than stages ({m} < {p}); "
                f"use at least {p} micro-batches, or --schedule gpipe")
    if schedule in ("interleaved", "zero-bubble") or (schedule == "1f1b" and v > 1):
        rounds = max(1, m // p)
        if m % rounds:
            cls = "ScheduleInterleavedZeroBubble" if schedule == "zero-bubble" else "ScheduleInterleaved1F1B"
            return (f"PyTorch's {cls} needs the micro-batches to be a multiple of its rounds "
                    f"(max(1, m // p) = {rounds}), got {m}")
    return None


def _gpipe(p: int, v: int, m: int, r: int) -> list:
    """Every forward, then every backward: ``ScheduleGPipe`` (v = 1) runs the micro-batches'
    backwards in order, ``ScheduleLoopedBFS`` chunk by chunk, last chunk and micro-batch first."""
    stages = [r + k * p for k in range(v)]
    fwd = [(s, "F", i) for s in stages for i in range(m)]
    if v == 1:
        return fwd + [(r, "B", i) for i in range(m)]
    return fwd + [(s, "B", i) for s in reversed(stages) for i in reversed(range(m))]


def _one_f_one_b(p: int, m: int, r: int) -> list:
    """``Schedule1F1B``: p - 1 - r warm-up forwards, then one forward one backward, then the
    remaining backwards."""
    warm = min(p - 1 - r, m)
    out = [(r, "F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [(r, "F", warm + i), (r, "B", i)]
    return out + [(r, "B", i) for i in range(m - warm, m)]


def _interleaved(p: int, v: int, m: int, r: int, zero_bubble: bool) -> list:
    """``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``: warm-up forwards, then
    forward-backward pairs, then the remaining backwards; forwards walk the rank's chunks in
    rounds of m // max(1, m // p) micro-batches, backwards walk them from the last. Zero-bubble
    splits each backward into I now and W later: rank r defers its first r weight backwards."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    fwd_mb, bwd_mb, out, pending = [0] * v, [0] * v, [], []

    def step(counter, k, kind):
        counter[k] += 1
        return (k * p + r, kind, counter[k] - 1)

    for op in range(m * v + warm):
        if op < m * v:
            out.append(step(fwd_mb, op // per_round % v, "F"))
        if op >= warm:
            back = step(bwd_mb, v - 1 - (op - warm) // per_round % v, "I" if zero_bubble else "B")
            out.append(back)
            pending += [back] if zero_bubble else []
            if zero_bubble and op - warm >= r:
                s, _, i = pending.pop(0)
                out.append((s, "W", i))
    return out + [(s, "W", i) for s, _, i in pending]


def rank_actions(p: int, v: int, m: int, rank: int, schedule: str) -> list:
    """Rank ``rank``'s actions in the order its schedule runs them (PyTorch's
    ``pipeline_order[rank]`` without the idle slots and the gradient reductions)."""
    _check(p, v, m, schedule)
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    problem = schedule_problem(p, v, m, schedule)
    if problem:
        raise ValueError(problem)
    if schedule == "gpipe":
        return _gpipe(p, v, m, rank)
    if schedule == "1f1b" and v == 1:
        return _one_f_one_b(p, m, rank)
    return _interleaved(p, v, m, rank, zero_bubble=schedule == "zero-bubble")


def held(actions) -> int:
    """Chunk-micro-batches of activations held at the peak of an action list: forwards add
    one, full and weight backwards free one."""
    live = peak = 0
    for _, kind, _ in actions:
        live += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        peak = max(peak, live)
    return peak


def held_bytes(actions, per_stage: dict, kept: dict = None, since_backward: bool = True) -> tuple:
    """(bytes, {stage: micro-batches live}, {stage: forwards run}) at the peak of an action
    list when a forward of stage s holds ``per_stage[s]`` bytes until its full or weight
    backward ends, and ``kept[s]`` until the step ends (the last stage's outputs):
    :func:`held` weighted, for chunks that hold different activations (the head's logits and
    loss). A backward is counted while it runs (its micro-batch still held). The peak from the
    rank's first backward on (``since_backward``: the backward after it, once gradients exist),
    else up to and through that first backward (before any gradient); (0, {}, {}) if none."""
    kept = kept or {}
    live, runs, best, started = {}, {}, (0, {}, {}), False
    for s, kind, _ in actions:
        first_backward = not started and kind in ("B", "I")
        started = started or kind in ("B", "I")
        if kind == "F":
            live[s], runs[s] = live.get(s, 0) + 1, runs.get(s, 0) + 1
        if (started and not first_backward) == since_backward:
            now = sum(n * per_stage[k] for k, n in live.items()) + sum(n * kept.get(k, 0) for k, n in runs.items())
            if now > best[0]:
                best = (now, dict(live), dict(runs))
        if kind in ("B", "W"):
            live[s] -= 1
    return best


def _needs(action, n_stages: int):
    """The action whose result this one waits for (None: nothing)."""
    s, kind, i = action
    if kind == "F":
        return (s - 1, "F", i) if s > 0 else None
    if kind == "W":
        return (s, "dx", i)
    return (s + 1, "dx", i) if s < n_stages - 1 else (s, "F", i)


def step_time(orders, n_stages: int) -> int:
    """When the last rank finishes: each rank runs its list in order, an action starting when
    the rank is free and what it needs is done (:data:`DURATION`; sends take no time)."""
    done, free, pos = {}, [0] * len(orders), [0] * len(orders)
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                action = order[pos[r]]
                need = _needs(action, n_stages)
                if need is not None and need not in done:
                    break
                free[r] = max(free[r], done.get(need, 0)) + DURATION[action[1]]
                s, kind, i = action
                done[(s, "F" if kind == "F" else "dx" if kind in ("B", "I") else "W", i)] = free[r]
                pos[r], left, moved = pos[r] + 1, left - 1, True
        if not moved:
            raise ValueError("the schedule deadlocks: an action waits for one that never runs")
    return max(free)


@functools.lru_cache(maxsize=256)
def simulate(p: int, v: int, m: int, schedule: str) -> Simulation:
    """The schedule's figures for (p, v, m), from its action lists."""
    orders = [rank_actions(p, v, m, r, schedule) for r in range(p)]
    units = step_time(orders, p * v)
    ideal = 3 * v * m
    return Simulation(tuple(held(o) for o in orders), (units - ideal) / ideal, units)
