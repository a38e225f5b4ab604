"""Pipeline schedules against PyTorch's own schedule objects: for every schedule name and many
(p, v, m), the action lists torchledger simulates equal the ``pipeline_order`` PyTorch's class
builds (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``), the in-flight counts and the bubble equal what this file
computes from PyTorch's lists on its own, and PyTorch's refusals are torchledger's."""
from __future__ import annotations

import functools
import logging
import sys

import pytest

from _pipeline_models import write_model
from torchledger.formulas.pipeline import bubble_fraction, in_flight, schedule_problem
from torchledger.formulas.schedules import rank_actions

S = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [(p, v, m) for p in range(1, 6) for v in range(1, 4) for m in range(1, 11)]


class _Stage:
    """What a schedule's constructor reads of a stage (no module, no process group)."""

    def __init__(self, index, n_stages, p):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, p, 0
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = None


def _cls(schedule, v):
    return {"gpipe": S.ScheduleGPipe if v == 1 else S.ScheduleLoopedBFS,
            "1f1b": S.Schedule1F1B if v == 1 else S.ScheduleInterleaved1F1B,
            "interleaved": S.ScheduleInterleaved1F1B,
            "zero-bubble": S.ScheduleInterleavedZeroBubble}[schedule]


KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


@functools.lru_cache(maxsize=None)
def pytorch_order(schedule, p, v, m):
    """PyTorch's ``pipeline_order``: {rank: [(stage, kind, micro-batch), ...]} without idle
    slots and gradient reductions; the ValueError's text where the class refuses (p, v, m)."""
    cls = _cls(schedule, v)
    logging.disable(logging.WARNING)       # the zero-bubble class logs the bubbles it adds
    try:
        if issubclass(cls, S.PipelineScheduleSingle):
            order = cls(_Stage(0, p, p), m).pipeline_order
        else:
            order = cls([_Stage(k * p, p * v, p) for k in range(v)], m).pipeline_order
    except ValueError as e:
        return str(e)
    finally:
        logging.disable(logging.NOTSET)
    out = {}
    for r in range(p):
        acts = [(a.stage_index, KIND[a.computation_type.name], a.microbatch_index)
                for a in order[r] if a is not None and a.computation_type.name in KIND]
        out[r] = _renumber_forwards(acts)
    return out


def _renumber_forwards(acts):
    """PyTorch's Schedule1F1B IR numbers the last rank's forwards from 1 (F1 B0 F2 B1 ...; its
    ``_step_microbatches`` runs 0 .. m-1): forwards of a stage are numbered in order."""
    seen = {}
    out = []
    for s, kind, i in acts:
        if kind == "F":
            i = seen[s] = seen.get(s, -1) + 1
        out.append((s, kind, i))
    return out


def _held(acts):
    live, peak = 0, 0
    for _, kind, _ in acts:
        if kind == "F":
            live += 1
        elif kind in ("B", "W"):          # zero-bubble: the weight backward frees the saved inputs
            live -= 1
        peak = max(peak, live)
    return peak


def _bubble(order, n_stages, v, m):
    """The longest path through the lists: an action ends its duration (F, I, W 1; B 2) after
    the rank's previous action and what it waits for (the previous stage's forward; the next
    stage's backward, or the forward for the last stage; its own I for W)."""
    where = {a: (r, k) for r, acts in order.items() for k, a in enumerate(acts)}
    dur = {"F": 1, "B": 2, "I": 1, "W": 1}
    limit = sys.getrecursionlimit()

    @functools.lru_cache(maxsize=None)
    def end(r, k):
        s, kind, i = order[r][k]
        waits = [end(r, k - 1)] if k else [0]
        if kind == "F" and s > 0:
            waits.append(end(*where[(s - 1, "F", i)]))
        elif kind in ("B", "I"):
            deps = [(s, "F", i)] if s == n_stages - 1 else [(s + 1, "B", i), (s + 1, "I", i)]
            waits += [end(*where[d]) for d in deps if d in where]
        elif kind == "W":
            waits.append(end(*where[(s, "I", i)]))
        return max(waits) + dur[kind]

    # the recursion is as deep as the longest chain of actions; the limit is put back after
    # (a raised limit left behind changes what later tests in this process see)
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        total = max(end(r, len(acts) - 1) for r, acts in order.items())
    finally:
        sys.setrecursionlimit(limit)
    return (total - 3 * v * m) / (3 * v * m)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe", "zero-bubble"])
def test_action_lists_are_pytorchs(schedule):
    checked = 0
    for p, v, m in CASES:
        ref = pytorch_order(schedule, p, v, m)
        problem = schedule_problem(p, v, m, schedule)
        assert isinstance(ref, str) == (problem is not None), (p, v, m, ref, problem)
        if isinstance(ref, str):
            continue
        for r in range(p):
            assert _renumber_forwards(rank_actions(p, v, m, r, schedule)) == ref[r], (p, v, m, r)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe", "zero-bubble"])
def test_in_flight_and_bubble_from_pytorchs_lists(schedule):
    for p, v, m in CASES:
        ref = pytorch_order(schedule, p, v, m)
        if isinstance(ref, str):
            with pytest.raises(ValueError):
                bubble_fraction(p, v, m, schedule)
            continue
        assert [in_flight(p, v, m, r, schedule) for r in range(p)] == [_held(ref[r]) for r in range(p)], (p, v, m)
        assert bubble_fraction(p, v, m, schedule) == pytest.approx(_bubble(ref, p * v, v, m)), (p, v, m)


def test_off_the_common_case_by_hand():
    # GPipe with virtual stages (ScheduleLoopedBFS): (p - 1) / (v m), not (p - 1) / m
    assert bubble_fraction(4, 2, 8, "gpipe") == 3 / 16
    assert bubble_fraction(4, 1, 8, "gpipe") == 3 / 8
    # interleaved with m < p: the ranks wait on each other, (p - 1) / (v m) = 0.75 is 1.25
    # (27 units over the ideal 3 x 2 x 2 = 12)
    assert bubble_fraction(4, 2, 2, "interleaved") == 1.25
    # interleaved with m = 6, not a multiple of p = 4: one round of 6, rank 0 warms up with
    # (v - 1) x 6 + 2 x 3 = 12 forwards (all of them) before its first backward
    assert [in_flight(4, 2, 6, r, "interleaved") for r in range(4)] == [12, 11, 9, 7]
    # zero-bubble keeps each forward's saved inputs until its weight backward
    assert [in_flight(4, 2, 8, r, "zero-bubble") for r in range(4)] == [8, 8, 8, 8]
    # the common case unchanged: Llama-3.1-405B at p 9, v 7, m 18
    assert bubble_fraction(9, 7, 18, "interleaved") == pytest.approx(8 / 126)
    assert [in_flight(9, 7, 18, r, "interleaved") for r in range(9)] == list(range(71, 54, -2))


def test_refusals_are_pytorchs():
    assert "Schedule1F1B refuses fewer micro-batches than stages (3 < 4)" in schedule_problem(4, 1, 3, "1f1b")
    assert "multiple of its rounds (max(1, m // p) = 2), got 9" in schedule_problem(4, 2, 9, "interleaved")
    assert schedule_problem(4, 1, 3, "gpipe") is None
    assert schedule_problem(4, 2, 3, "interleaved") is None




def test_1f1b_with_fewer_micro_batches_than_stages_is_one_line(tmp_path):
    pytest.importorskip("torch.distributed")
    from click.testing import CliRunner
    from torchledger.cli import cli
    from test_audit_cli import one_line_error
    path = write_model(tmp_path)
    result = CliRunner().invoke(cli, ["audit", str(path), "--mesh", "pp=4", "--micro-batches", "2"])
    one_line_error(result, "Schedule1F1B refuses fewer micro-batches than stages (2 < 4)", "--schedule gpipe")


@pytest.mark.slow
@pytest.mark.parametrize("schedule, m", [("interleaved", 3), ("zero-bubble", 4)])
def test_a_pipeline_audit_holds_what_pytorchs_schedule_holds(tmp_path, schedule, m):
    """pp=2 x 2 virtual stages off the common case: interleaved at m = 3 (not a multiple of
    p; the closed form said [5, 3]), zero-bubble at m = 4 (F minus W; it said [5, 3])."""
    pytest.importorskip("torch.distributed")
    from torchledger.audit.engine import run_audit
    path = write_model(tmp_path)
    rec = run_audit(str(path), mesh="pp=2", plan={"micro_batches": m, "virtual_stages": 2,
                                                   "schedule": schedule}).record
    pipe = rec.totals["pipeline"]
    ref = pytorch_order(schedule, 2, 2, m)
    stages = sorted(pipe["per_stage"], key=lambda s: s["rank"])
    assert [s["in_flight"] for s in stages] == [_held(ref[r]) for r in range(2)]
    assert pipe["bubble_fraction"] == pytest.approx(_bubble(ref, 4, 2, m))
    for s in stages:       # the peak: the traced micro-step's + the schedule's extra chunk activations
        live, per = s["live_at_peak"], s["chunk_micro_batch_bytes"]
        # PyTorch's count at most: the count's peak may come in the first backward, before any
        # gradient, and the bytes' peak after it, with the gradients
        assert sum(live.values()) <= s["in_flight"]
        extra = sum((live.get(c, 0) - 1) * n for c, n in per.items())
        assert s["peak_bytes"] == s["traced_peak_bytes"] + extra + sum(s["stage_buffer_bytes"].values())
