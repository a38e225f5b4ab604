"""The step's ops in the order they ran, as runs of (phase, module): ``record.memory["segments"]``.

Each segment is one stretch of consecutive ops with the same phase and innermost module::

    {"start": 12, "end": 15, "phase": "forward", "module": "blocks.0.attn.q_proj",
     "ops": [["aten.t.default", 1, 0], ["aten.addmm.default", 1, 2097152]]}

``start``/``end`` are op indices (end exclusive), on the same axis as ``memory.timeline``'s
``op_index``; ``ops`` lists [op, count, matmul-class FLOPs] for runs of the same op, in order.
The Trace Event renderer (``render/trace_events.py``) lays them out on a timeline.

Known limitations:
- When a step has more than ``MAX_OP_RUNS`` op runs in all, each segment's ``ops`` is merged
  per op name (first-seen order, counts and FLOPs exact, order within the segment lost) and
  ``memory["segments_merged"]`` is true; this bounds the record of a large model.
- Segments past the first ``MAX_SEGMENTS`` are not kept (``memory["segments_dropped"]`` counts them).
"""
from __future__ import annotations

from .dispatch import PHASES

__all__ = ["op_segments"]

MAX_OP_RUNS = 10_000
MAX_SEGMENTS = 50_000


def op_segments(mode, scope) -> dict:
    """``{"segments": [...]}`` (plus ``segments_merged``/``segments_dropped`` when bounded)
    from the tracer's per-op lists; ``{}`` when there are none."""
    phases, mods, funcs, flops = mode.op_phase, mode.op_module, mode.op_func, mode.op_flops
    n = min(len(phases), len(mods), len(funcs), len(flops))   # equal unless an op failed half-recorded
    if n == 0:
        return {}
    names: dict = {}

    def op_name(fid):
        name = names.get(fid)
        if name is None:
            func = mode.funcs.get(fid)
            name = names[fid] = str(func) if func is not None else "(unknown op)"
        return name

    segs, runs = [], 0
    i = 0
    while i < n:
        ph, mod = phases[i], mods[i]
        j = i
        ops: list = []
        while j < n and phases[j] == ph and mods[j] == mod:
            if ops and ops[-1][3] == funcs[j]:
                ops[-1][1] += 1
                ops[-1][2] += flops[j]
            else:
                ops.append([None, 1, flops[j], funcs[j]])
            j += 1
        runs += len(ops)
        segs.append((i, j, ph, mod, ops))
        i = j
    merged = runs > MAX_OP_RUNS
    out = []
    for start, end, ph, mod, ops in segs[:MAX_SEGMENTS]:
        if merged:
            by_op: dict = {}
            for r in ops:
                m = by_op.setdefault(r[3], [None, 0, 0, r[3]])
                m[1] += r[1]
                m[2] += r[2]
            ops = list(by_op.values())
        out.append({"start": start, "end": end, "phase": PHASES[ph],
                    "module": scope.name(mod),
                    "ops": [[op_name(r[3]), r[1], int(r[2])] for r in ops]})
    result = {"segments": out}
    if merged:
        result["segments_merged"] = True
    if len(segs) > MAX_SEGMENTS:
        result["segments_dropped"] = len(segs) - MAX_SEGMENTS
    return result
