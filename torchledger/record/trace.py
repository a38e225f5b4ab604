"""The traced step as Trace Event JSON (the record's ``to_trace()``), for ui.perfetto.dev and chrome://tracing.

    >>> import json; json.dump(t.record.to_trace(), open("step.trace.json", "w"))   # then open it in Perfetto

(``torchledger.render.trace_events.render_trace`` writes the same as text, one event per line.)

One process, ``torchledger step``, with:

- thread 1, ``phases > modules > ops``: complete events (``"ph": "X"``) for each phase, the
  module slices nested inside it (``blocks`` > ``blocks.0`` > ``blocks.0.attn`` ...), and the
  ops inside those, one slice per run of the same op with its count and matmul-class FLOPs;
- counter tracks (``"ph": "C"``) ``live memory`` with one series per category (parameters,
  gradients, optimizer state, activations, temporaries ...), from ``memory.timeline``;
- thread 2, ``copies``: one instant event (``"ph": "i"``) per group of copies (reason, bytes,
  source line), at the first op of that kind in its module and phase;
- thread 3, ``findings``: one instant event per finding, at its module's first slice.

The clock is synthetic: the record keeps the order of ops, not their durations (fake tensors
have none), so ``ts`` is the op index and every op lasts 1 us. ``otherData.clock`` and the
process name say so; ``otherData.step_seconds`` is the measured step time, when there is one.

Byte-for-byte deterministic for a given record: no wall clock, no ids, keys sorted, one event
per line.

Known limitations:
- Records saved before ``memory.segments`` existed have no op order: their phases are laid out
  from the sampled memory timeline (boundaries to within one sample) and modules and ops are
  not drawn; ``otherData.layout`` says which.
- Copies and findings carry no op index of their own; they are placed at the first op (or
  slice) that matches their op, module and phase.
"""
from __future__ import annotations

import json

from .finding import EMPTY_SENTENCE, as_findings, is_empty

__all__ = ["trace_events", "SYNTHETIC_CLOCK", "plain"]

SYNTHETIC_CLOCK = "synthetic: ts is the op index, 1 op = 1 us (the record keeps op order, not op times)"
_PID = 1
_STEP_TID, _COPY_TID, _FINDING_TID = 1, 2, 3
_NOT_CATEGORIES = ("op_index", "phase", "total")


def trace_events(record, findings=None) -> dict:
    """The trace as a dict (what :meth:`StepRecord.to_trace` returns)."""
    memory = record.memory or {}
    segments = [s for s in memory.get("segments") or [] if isinstance(s, dict)]
    meta = record.meta or {}
    types = {m.get("name"): m.get("type") for m in record.modules or [] if isinstance(m, dict)}
    events: list = []          # (tid, ts, -dur, depth, event)
    if is_empty(record):
        layout = EMPTY_SENTENCE
    elif segments:
        layout = "op order from memory.segments"
        _step_slices(segments, types, events)
    else:
        layout = ("phases from the sampled memory timeline (this record has no memory.segments: "
                  "modules and ops are not drawn)")
        _timeline_phases(memory.get("timeline") or [], events)
    _memory_counters(memory, events)
    phase_starts: dict = {}            # where each phase first shows in the memory timeline
    for row in memory.get("timeline") or []:
        if isinstance(row, dict):
            phase_starts.setdefault(row.get("phase"), int(row.get("op_index", 0)))
    _copy_instants(record.copies or [], segments, phase_starts, events)
    _finding_instants(as_findings(record, findings), segments, events)
    events.sort(key=lambda e: e[:4])
    model = meta.get("model") or "model"
    head = [_meta("process_name", 0, {"name": f"torchledger step: {model} (clock: 1 op = 1 us, synthetic)"}),
            _meta("thread_name", _STEP_TID, {"name": "phases > modules > ops"}),
            _meta("thread_name", _COPY_TID, {"name": "copies"}),
            _meta("thread_name", _FINDING_TID, {"name": "findings"})]
    head += [_meta("thread_sort_index", tid, {"sort_index": tid}) for tid in (_STEP_TID, _COPY_TID, _FINDING_TID)]
    totals = record.totals or {}
    other = {"generator": "torchledger", "schema": "torchledger/1", "clock": SYNTHETIC_CLOCK, "layout": layout,
             "model": meta.get("model"), "device": meta.get("device"), "dtype": meta.get("dtype"),
             "ops": meta.get("ops", 0), "step_seconds": totals.get("step_seconds"),
             "flops_total": (totals.get("flops") or {}).get("total", 0), "peak_bytes": totals.get("peak_bytes", 0)}
    if memory.get("segments_merged"):
        other["note"] = "op runs merged per op within each module slice (a large step): order inside a slice is lost"
    return {"traceEvents": head + [e[4] for e in events], "otherData": other}


def _meta(name: str, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": _PID, "tid": tid, "args": args}


def _slice(name: str, cat: str, ts: int, dur: int, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": _PID, "tid": _STEP_TID,
            "args": args}


def _chain(module) -> list:
    """``"blocks.0.attn"`` -> ``["", "blocks", "blocks.0", "blocks.0.attn"]``; ops outside every
    module (``None``, ``"(no module)"``) sit directly in their phase."""
    if module is None or module == "(no module)" or not isinstance(module, str):
        return []
    if module == "":
        return [""]
    parts = module.split(".")
    return [""] + [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _step_slices(segments: list, types: dict, events: list) -> None:
    """Phase slices, module slices nested in them, op runs inside: one pass, closing a
    slice when the next segment leaves it."""
    phase = None               # [name, start, ops, flops]
    open_mods: list = []       # [[module, start, flops], ...] outermost first

    def close_mods(keep: int, at: int) -> None:
        while len(open_mods) > keep:
            name, start, flops = open_mods.pop()
            label = name if name else "(root)"
            args = {"module": name, "type": types.get(name), "flops": flops}
            events.append((_STEP_TID, start, start - at, 1 + len(open_mods), _slice(label, "module", start, at - start, args)))

    def close_phase(at: int) -> None:
        close_mods(0, at)
        if phase is not None:
            name, start, n_ops, flops = phase
            events.append((_STEP_TID, start, start - at, 0,
                           _slice(name, "phase", start, at - start, {"ops": n_ops, "flops": flops})))

    end = 0
    for seg in segments:
        start, stop = int(seg.get("start", end)), int(seg.get("end", end))
        if start < end or stop < start:       # not in op order: nothing trustworthy to draw
            continue
        if sum(max(int(run[1]), 0) for run in seg.get("ops") or []) != stop - start:
            continue        # op runs that do not fill [start, end) would draw outside the phase
        if phase is None or seg.get("phase") != phase[0] or start != end:
            close_phase(end)
            phase = [str(seg.get("phase")), start, 0, 0]
        chain = _chain(seg.get("module"))
        keep = 0
        while keep < len(open_mods) and keep < len(chain) and open_mods[keep][0] == chain[keep]:
            keep += 1
        close_mods(keep, start)
        for name in chain[keep:]:
            open_mods.append([name, start, 0])
        t = start
        depth = 1 + len(open_mods)
        for run in seg.get("ops") or []:
            op, count, flops = str(run[0]), int(run[1]), int(run[2])
            if count <= 0:
                continue
            events.append((_STEP_TID, t, -count, depth,
                           _slice(op, "op", t, count, {"count": count, "flops": flops, "phase": phase[0],
                                                       "module": seg.get("module")})))
            t += count
            for m in open_mods:
                m[2] += flops
            phase[3] += flops
        phase[2] += stop - start
        end = stop
    close_phase(end)


def _timeline_phases(rows: list, events: list) -> None:
    runs: list = []            # [phase, first op index, last op index]
    for row in rows:
        if not isinstance(row, dict) or row.get("phase") is None:
            continue
        i = int(row.get("op_index", 0))
        if runs:                    # a phase lasts until the next sample (the next phase's first)
            runs[-1][2] = max(runs[-1][2], i)
        if row["phase"] != "end" and not (runs and runs[-1][0] == row["phase"]):
            runs.append([row["phase"], i, i])
    for phase, start, stop in runs:
        dur = max(stop - start, 1)
        events.append((_STEP_TID, start, -dur, 0,
                       _slice(str(phase), "phase", start, dur, {"approximate": True})))


def _memory_counters(memory: dict, events: list) -> None:
    rows = [r for r in memory.get("timeline") or [] if isinstance(r, dict)]
    cats = [c for c in memory.get("categories") or [] if c not in _NOT_CATEGORIES]
    if not cats and rows:
        cats = [k for k in rows[0] if k not in _NOT_CATEGORIES]
    for row in rows:
        ts = int(row.get("op_index", 0))
        args = {c: int(row.get(c, 0)) for c in cats}
        events.append((0, ts, 0, 0, {"ph": "C", "name": "live memory (bytes)", "ts": ts, "pid": _PID,
                                     "tid": 0, "args": args}))


def _first_op(segments: list, module, phase, op_suffix=None):
    """Op index of the first op (ending in ``op_suffix``, if given) of ``module`` in ``phase``."""
    for seg in segments:
        if (module is not None and seg.get("module") != module) or (phase is not None and seg.get("phase") != phase):
            continue
        t = int(seg.get("start", 0))
        for run in seg.get("ops") or []:
            if op_suffix is None or str(run[0]).endswith(op_suffix):
                return t
            t += int(run[1])
    return None


def _copy_instants(copies: list, segments: list, phase_starts: dict, events: list) -> None:
    for c in copies:
        if not isinstance(c, dict):
            continue
        op = str(c.get("op", "copy"))
        ts = _first_op(segments, c.get("module"), c.get("phase"), "." + op) if "." in op else None
        if ts is None:
            ts = _first_op(segments, c.get("module"), c.get("phase"), op)
        if ts is None:
            ts = _first_op(segments, c.get("module"), c.get("phase"))
        if ts is None:
            ts = phase_starts.get(c.get("phase"), 0)
        args = dict(c)
        name = f"copy: {c.get('reason', op)}" + (f" at {c['location']}" if c.get("location") else "")
        events.append((_COPY_TID, ts, 0, 0, {"ph": "i", "s": "t", "name": name, "cat": "copy", "ts": ts,
                                             "pid": _PID, "tid": _COPY_TID, "args": args}))


def _finding_instants(findings: list, segments: list, events: list) -> None:
    for f in findings:
        ts = None
        if f.module is not None:
            ts = _first_op(segments, f.module, "forward")
            if ts is None:
                ts = _first_op(segments, f.module, None)
        ts = ts or 0
        args = {k: v for k, v in f.to_dict().items() if v is not None}
        events.append((_FINDING_TID, ts, 0, 0, {"ph": "i", "s": "p", "name": f"{f.severity} {f.rule}",
                                                "cat": "finding", "ts": ts, "pid": _PID, "tid": _FINDING_TID,
                                                "args": args}))


def plain(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return sorted(x) if isinstance(x, set) else list(x)
    return str(x)
