"""A traced step's record leaves (almost) nothing for CPython's cyclic collector to walk
(issue 25): op runs and shapes are tuples of plain values, which the collector stops
tracking, and the dicts holding them are made untracked; the JSON is unchanged (lists).

A list per op run made each traced 7B step bring the next full collection (the whole heap,
~190 ms with a fake llama2-7b) closer: ``benchmarks/record_gc.py`` measures it.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import random

import numpy as np
import pytest
import torch

import torchledger
from _optional_hypothesis import given, settings, st
from torchledger.models import build_model, example_inputs, get_config
from torchledger.record import StepRecord
from torchledger.tracer import segments
from torchledger.tracer.build import _downsample
from torchledger.tracer.dispatch import PHASES

def _benchmark():
    """benchmarks/record_gc.py, whose ``tracked_in`` these tests count with."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "record_gc.py")
    spec = importlib.util.spec_from_file_location("record_gc_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tracked_in = _benchmark().tracked_in


@pytest.fixture(scope="module")
def record():
    """A 2-block GPT's training step: ~60 segments, ~200 op runs."""
    torch.manual_seed(0)
    cfg = get_config("gpt2-tiny").replace(n_layers=2)
    model = build_model(cfg)
    inputs = example_inputs(cfg, batch=1, seq_len=8)
    opt = torch.optim.AdamW(model.parameters())
    assert gc.isenabled()
    with torchledger.trace(model, optimizer=opt, tokens=8) as t:
        model(**inputs).backward()
        opt.step()
    return t.record


# -- what the collector sees ----------------------------------------------------------------
def test_segments_leave_one_tracked_list_before_any_full_collection(record):
    segs = record.memory["segments"]
    runs = sum(len(s["ops"]) for s in segs)
    assert len(segs) > 30 and runs > 100
    gc.collect(1)       # the young generations only: dicts are untracked by full collections alone
    # the list itself; a dict or list per segment or per run would be > 130
    assert tracked_in(segs) == 1


def test_record_memory_holds_a_bounded_number_of_tracked_containers(record):
    gc.collect()
    # memory, segments, timeline, categories, cuda, retained, module_caches: one each at most,
    # however many ops the step ran (a list per op run: hundreds here, ~11k for llama2-7b)
    assert tracked_in(record.memory) <= 12


def test_op_shapes_are_untracked_entries(record):
    gc.collect()
    shaped = [o for o in record.ops if o.get("shapes")]
    assert sum(len(o["shapes"]) for o in shaped) >= 10
    # each row with shapes: the row and its shapes list; the entries (dicts of a tuple and
    # plain values) are untracked, as the tuples in them
    assert tracked_in(record.ops) == 1 + 2 * len(shaped)


def test_traced_record_round_trips_with_its_tuples(record):
    again = StepRecord.from_dict(record.to_dict())          # tuples are JSON lists to the schema
    assert again == record
    text = record.to_json()
    back = StepRecord.from_json(text)
    assert back.to_json() == text
    run = back.memory["segments"][0]["ops"][0]
    assert isinstance(run, list) and list(record.memory["segments"][0]["ops"][0]) == run


def test_young_collections_only_where_cheap(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    monkeypatch.setattr(gc, "get_count", lambda: (650, 3, 1))
    segments._untrack_young()
    assert calls == [0]                         # the youngest generation, never an older one
    gc.disable()
    try:
        segments._untrack_young()               # the user turned the collector off: left off
    finally:
        gc.enable()
    monkeypatch.setattr(gc, "get_count", lambda: (segments._YOUNG_LIMIT + 1, 0, 0))
    segments._untrack_young()                   # thresholds raised: a young collection is no longer cheap
    monkeypatch.setattr(gc, "get_count", lambda: (650, 3, 1))
    monkeypatch.setattr(segments, "_GENERATIONAL", False)
    segments._untrack_young()                   # free-threaded: one generation, the whole heap
    assert calls == [0]


# -- op_segments: a hand-checked case and a plain loop as the oracle ------------------------
class _Scope:
    def name(self, i):
        return f"m{i}" if i >= 0 else "(no module)"


class _Mode:
    def __init__(self, phases, mods, funcs, flops):
        self.op_phase, self.op_module, self.op_func, self.op_flops = phases, mods, funcs, flops
        self.funcs = {11: "aten.a", 12: "aten.b", 13: "aten.c"}


def test_op_segments_hand_checked():
    F, B = PHASES.index("forward"), PHASES.index("backward")
    mode = _Mode([F, F, F, B, B, B], [0, 0, 1, 1, 1, -1], [11, 11, 12, 12, 11, 99], [2, 3, 0, 5, 7, 1])
    out = segments.op_segments(mode, _Scope())
    assert out == {"segments": [
        {"start": 0, "end": 2, "phase": "forward", "module": "m0", "ops": (("aten.a", 2, 5),)},   # 2 + 3
        {"start": 2, "end": 3, "phase": "forward", "module": "m1", "ops": (("aten.b", 1, 0),)},
        {"start": 3, "end": 5, "phase": "backward", "module": "m1",
         "ops": (("aten.b", 1, 5), ("aten.a", 1, 7))},
        {"start": 5, "end": 6, "phase": "backward", "module": "(no module)", "ops": (("(unknown op)", 1, 1),)},
    ]}
    assert segments.op_segments(_Mode([], [], [], []), _Scope()) == {}


def _plain_segments(mode, scope, max_runs, max_segments) -> dict:
    """The rule of segments.py's docstring, one op at a time."""
    n = min(len(mode.op_phase), len(mode.op_module), len(mode.op_func), len(mode.op_flops))
    if n == 0:
        return {}
    segs = []
    for i in range(n):
        key = (mode.op_phase[i], mode.op_module[i])
        fid, f = mode.op_func[i], mode.op_flops[i]
        if not segs or segs[-1][0] != key:
            segs.append([key, i, i, []])
        seg = segs[-1]
        seg[2] = i + 1
        if seg[3] and seg[3][-1][0] == fid:
            seg[3][-1][1] += 1
            seg[3][-1][2] += f
        else:
            seg[3].append([fid, 1, f])
    merged = sum(len(s[3]) for s in segs) > max_runs
    out = []
    for (ph, mod), start, end, runs in segs[:max_segments]:
        if merged:
            by_op: dict = {}
            for fid, count, f in runs:
                m = by_op.setdefault(fid, [fid, 0, 0])
                m[1] += count
                m[2] += f
            runs = list(by_op.values())
        out.append({"start": start, "end": end, "phase": PHASES[ph], "module": scope.name(mod),
                    "ops": [[mode.funcs.get(fid, "(unknown op)"), count, f] for fid, count, f in runs]})
    result = {"segments": out}
    if merged:
        result["segments_merged"] = True
    if len(segs) > max_segments:
        result["segments_dropped"] = len(segs) - max_segments
    return result


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(10_000, 50_000), (3, 50_000), (10_000, 2), (4, 3)]))
def test_op_segments_match_a_plain_loop(seed, limits):
    rng = random.Random(seed)
    n = rng.randint(0, 40)
    mode = _Mode([rng.choice([0, 0, 0, 1, 2]) for _ in range(n)], [rng.choice([-1, 0, 1]) for _ in range(n)],
                 [rng.choice([11, 12, 13, 99]) for _ in range(n)], [rng.choice([0, 3, 10**12]) for _ in range(n)])
    if n and rng.random() < 0.2:
        mode.op_flops.pop()             # an op that failed half-recorded
    old = segments.MAX_OP_RUNS, segments.MAX_SEGMENTS
    segments.MAX_OP_RUNS, segments.MAX_SEGMENTS = limits
    try:
        got = segments.op_segments(mode, _Scope())
    finally:
        segments.MAX_OP_RUNS, segments.MAX_SEGMENTS = old
    assert json.loads(json.dumps(got)) == _plain_segments(mode, _Scope(), *limits)


# -- the sampled timeline ---------------------------------------------------------------------
@pytest.mark.parametrize("n, peak", [(1, 0), (7, 3), (400, 399), (401, 200), (1000, 517), (12345, 0)])
def test_timeline_samples_are_the_sorted_distinct_points_and_the_peak(n, peak):
    tl = np.arange(2 * n, dtype=np.int64).reshape(2, n)
    phase = np.zeros(n, dtype=np.int64)
    rows = _downsample(tl, phase, peak, ("a", "b"))
    want = np.unique(np.concatenate([np.linspace(0, n - 1, min(n, 400)).astype(np.int64), [peak]]))
    assert [r["op_index"] for r in rows] == want.tolist()
    assert all(r["total"] == r["a"] + r["b"] and r["b"] == r["a"] + n for r in rows)


def test_a_traced_step_does_not_call_np_unique(monkeypatch):
    """Its first call imports numpy.ma (~13 ms once per process); the record needs none of it."""
    def refuse(*args, **kwargs):
        raise AssertionError("np.unique called while building the record")
    monkeypatch.setattr(np, "unique", refuse)
    lin = torch.nn.Linear(4, 3)
    with torchledger.trace(lin, tokens=2) as t:
        lin(torch.randn(2, 4)).sum().backward()
    assert len(t.record.memory["timeline"]) == t.record.meta["ops"] + 1      # every point kept
    assert not [w for w in t.record.warnings if "unique" in w]
