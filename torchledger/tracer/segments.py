"""The step's ops in the order they ran, as runs of (phase, module): ``record.memory["segments"]``.

Each segment is one stretch of consecutive ops with the same phase and innermost module::

    {"start": 12, "end": 15, "phase": "forward", "module": "blocks.0.attn.q_proj",
     "ops": (("aten.t.default", 1, 0), ("aten.addmm.default", 1, 2097152))}

``start``/``end`` are op indices (end exclusive), on the same axis as ``memory.timeline``'s
``op_index``; ``ops`` lists (op, count, matmul-class FLOPs) for runs of the same op, in order.
In memory ``ops`` and its runs are tuples, in JSON lists (``[["aten.t.default", 1, 0], ...]``;
a record read back from JSON has lists): CPython's collector stops tracking a tuple of plain
values, and a dict made from untracked values is not tracked, so a 7B step's ~9k runs and ~1k
segments add nothing to the objects each full collection walks (a list per run made every
traced step bring the next full collection closer: benchmarks/record_gc.py).
The Trace Event renderer (``render/trace_events.py``) lays them out on a timeline.

Known limitations:
- When a step has more than ``MAX_OP_RUNS`` op runs in all, each segment's ``ops`` is merged
  per op name (first-seen order, counts and FLOPs exact, order within the segment lost) and
  ``memory["segments_merged"]`` is true; this bounds the record of a large model.
- Segments past the first ``MAX_SEGMENTS`` are not kept (``memory["segments_dropped"]`` counts them).
- The segment dicts are untracked only when the collector is enabled with a young generation of
  at most ``_YOUNG_LIMIT`` objects (two young collections, see :func:`_untrack_young`);
  otherwise they stay tracked until the next full collection, as any dict.
"""
from __future__ import annotations

import gc
import sysconfig

import numpy as np

from .phases import PHASES

__all__ = ["op_segments", "op_namer"]

MAX_OP_RUNS = 10_000
MAX_SEGMENTS = 50_000
#: The most young objects (``gc.get_count()[0]``) that :func:`_untrack_young` collects: its cost.
_YOUNG_LIMIT = 10_000
#: A free-threaded CPython has one generation: collecting "the youngest" walks the whole heap.
_GENERATIONAL = not sysconfig.get_config_var("Py_GIL_DISABLED")


def op_segments(mode, scope, op_name=None) -> dict:
    """``{"segments": [...]}`` (plus ``segments_merged``/``segments_dropped`` when bounded)
    from the tracer's per-op lists; ``{}`` when there are none. ``op_name(fid)`` names the op
    ``mode.funcs[fid]`` (default: its ``str``, ``"(unknown op)"`` when the mode lacks it)."""
    phases, mods, funcs, flops = mode.op_phase, mode.op_module, mode.op_func, mode.op_flops
    n = min(len(phases), len(mods), len(funcs), len(flops))   # equal unless an op failed half-recorded
    if n == 0:
        return {}
    if op_name is None:
        op_name = op_namer(mode.funcs)
    ph = np.asarray(phases[:n], dtype=np.int64)
    md = np.asarray(mods[:n], dtype=np.int64)
    fn = np.asarray(funcs[:n], dtype=np.uint64)             # id(func): an address, never negative
    new_seg = np.ones(n, dtype=bool)                         # op i starts a segment / a run
    new_seg[1:] = (ph[1:] != ph[:-1]) | (md[1:] != md[:-1])
    new_run = new_seg.copy()
    new_run[1:] |= fn[1:] != fn[:-1]
    seg_all, run_at = np.flatnonzero(new_seg), np.flatnonzero(new_run)
    n_segs, n_runs = len(seg_all), len(run_at)
    merged = n_runs > MAX_OP_RUNS            # counted over every segment, kept or not
    kept = min(n_segs, MAX_SEGMENTS)
    seg_at = seg_all[:kept]
    seg_end = np.append(seg_all[1:kept + 1], n)[:kept]
    first_run = np.searchsorted(run_at, seg_at).tolist()    # a segment's first run (every segment starts one)
    end = int(seg_end[-1])
    run_at = run_at[: np.searchsorted(run_at, end)]          # runs of the kept segments
    counts = np.diff(np.append(run_at, end)).tolist()
    run_flops = np.add.reduceat(np.asarray(flops[:end], dtype=np.int64), run_at).tolist()
    fids = fn[run_at].tolist()
    names = list(map({f: op_name(f) for f in set(fids)}.__getitem__, fids))
    bounds = list(zip(first_run, first_run[1:] + [len(run_at)]))
    if merged:
        runs = [_merged(fids[a:b], names[a:b], counts[a:b], run_flops[a:b]) for a, b in bounds]
    else:
        every = list(zip(names, counts, run_flops))
        runs = [every[a:b] for a, b in bounds]
        del every
    # NB: untrack the run tuples, then the tuples of them, then make the dicts (one collection
    # cannot do both levels: it may examine a tuple before the tuples inside it)
    _untrack_young()
    runs = [tuple(r) for r in runs]
    _untrack_young()
    out = [{"start": s, "end": e, "phase": PHASES[p], "module": scope.name(m), "ops": r}
           for s, e, p, m, r in zip(seg_at.tolist(), seg_end.tolist(), ph[seg_at].tolist(),
                                     md[seg_at].tolist(), runs)]
    result = {"segments": out}
    if merged:
        result["segments_merged"] = True
    if n_segs > MAX_SEGMENTS:
        result["segments_dropped"] = n_segs - MAX_SEGMENTS
    return result


def _merged(fids: list, names: list, counts: list, flops: list) -> list:
    """One segment's runs merged per op, in first-seen order."""
    by_op: dict = {}
    for fid, name, count, f in zip(fids, names, counts, flops):
        m = by_op.get(fid)
        if m is None:
            by_op[fid] = [name, count, f]
        else:
            m[1] += count
            m[2] += f
    return [tuple(m) for m in by_op.values()]


def op_namer(funcs: dict):
    """``fid -> str(funcs[fid])``, each op formatted once."""
    names: dict = {}

    def op_name(fid):
        name = names.get(fid)
        if name is None:
            func = funcs.get(fid)
            name = names[fid] = str(func) if func is not None else "(unknown op)"
        return name
    return op_name


def _untrack_young() -> None:
    """One collection of the youngest generation, when the collector is on and it is small.

    CPython stops tracking a tuple of untracked values when a collection examines it, and a
    dict made from untracked values starts untracked (dicts are only untracked again by a
    *full* collection). Collecting the young generation after the run tuples are made, again
    after the tuples of runs, and only then making the segment dicts leaves nothing in
    ``segments`` but the list itself tracked. Bounded: the young generation holds at most
    ``_YOUNG_LIMIT`` objects (its threshold is 700 by default); a disabled collector, and a
    free-threaded build's (no young generation), are left alone."""
    if _GENERATIONAL and gc.isenabled() and gc.get_count()[0] <= _YOUNG_LIMIT:
        gc.collect(0)
