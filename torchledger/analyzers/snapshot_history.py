"""The history in a CUDA memory snapshot's device traces (format: :mod:`.snapshot`): replay
allocated and reserved bytes event by event, rebuild free space and fragmentation at the peak
from the end state, find allocations never freed (per step when step starts are given), and
join each allocation to the module, phase and category the tracer's marks say were active.
The frame and segment-figure helpers that :mod:`.snapshot` also uses live here, so that this
module imports nothing from it. Pure Python over the snapshot dict (no torch).

    >>> h = replay(snap, device=0)
    >>> h["peak"]["allocated_bytes"], h["peak"]["fragmentation"]

Known limitations:
  - free space at the peak is rebuilt from the end state by undoing later events; event
    sizes are requested bytes (rounded up to 512 here, as blocks are), but a block may also
    keep an unsplit remainder (< 1 MiB in large segments), so free bytes at the peak are an
    upper bound and the largest free block may be overstated by up to that remainder.
  - a trace that hit ``max_entries`` holds only the newest events: figures before its first
    event are the end state minus the trace (``start``), not observed.
"""
from __future__ import annotations

import bisect

__all__ = ["replay", "never_freed", "join", "module_peaks", "segment_figures", "frame_tuple", "top_groups"]

ALLOCATED = "active_allocated"
SEG_ADD, SEG_SUB = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")
_BLOCK_ROUND = 512          # kMinBlockSize: every block is a multiple of 512 bytes


def _isint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- frames --------------------------------------------------------------------------------
def frame_tuple(frames) -> tuple:
    return tuple(f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '?')}"
                 for f in frames or () if isinstance(f, dict))


def _user_frame(frames: tuple):
    """The innermost frame outside torch itself (where the user's code asked), else the first."""
    for f in frames:
        path = f.rsplit(":", 1)[0].replace("\\", "/")
        if "/torch/" not in path and not path.startswith("<") and not path.startswith("??"):
            return f
    return frames[0] if frames else None


def top_groups(items, top: int) -> list:
    """(size, requested, frames) items grouped by identical stack, largest first."""
    groups: dict = {}
    for size, req, frames in items:
        g = groups.setdefault(frames, [0, 0, 0])
        g[0] += size
        g[1] += req
        g[2] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"size": g[0], "requested_size": g[1], "count": g[2], "location": _user_frame(fr),
             "frames": list(fr)} for fr, g in rows]


# -- figures of a list of segments ---------------------------------------------------------
def segment_figures(segs) -> dict:
    f = dict.fromkeys(("segments", "reserved_bytes", "allocated_bytes", "allocated_block_bytes",
                       "active_bytes", "pending_free_bytes", "free_bytes", "free_blocks",
                       "largest_free_bytes"), 0)
    for s in segs:
        f["segments"] += 1
        f["reserved_bytes"] += s["total_size"]
        for b in s["blocks"]:
            size, state = b["size"], b["state"]
            if state == ALLOCATED:
                f["allocated_bytes"] += b.get("requested_size", size)
                f["allocated_block_bytes"] += size
                f["active_bytes"] += size
            elif state.startswith("active"):
                f["active_bytes"] += size
                f["pending_free_bytes"] += size
            else:
                f["free_bytes"] += size
                f["free_blocks"] += 1
                f["largest_free_bytes"] = max(f["largest_free_bytes"], size)
    f["fragmentation"] = _fragmentation(f["largest_free_bytes"], f["free_bytes"])
    return f


def _fragmentation(largest: int, free: int) -> float:
    return 1.0 - largest / free if free else 0.0


# -- the history ---------------------------------------------------------------------------
def _trace(snap, device):
    if isinstance(snap, list):
        return snap
    traces = snap.get("device_traces", [])
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    return traces[device] if device < len(traces) else []


def _free_action(trace) -> str:
    return "free_requested" if any(e["action"] == "free_requested" for e in trace) else "free_completed"


def _curves(snap, device):
    """Allocated (requested) and reserved bytes after each event, and the start figures."""
    trace = _trace(snap, device)
    end = segment_figures([s for s in snap["segments"] if s.get("device", 0) == device])
    free = _free_action(trace)
    alloc, res, a, r = [], [], 0, 0
    for e in trace:
        act = e["action"]
        a += e["size"] if act == "alloc" else -e["size"] if act == free else 0
        r += e["size"] if act in SEG_ADD else -e["size"] if act in SEG_SUB else 0
        alloc.append(a)
        res.append(r)
    a0, r0 = end["allocated_bytes"] - a, end["reserved_bytes"] - r
    return trace, [a0 + x for x in alloc], [r0 + x for x in res], (a0, r0)


def replay(snap: dict, device: int = 0, points: int = 200) -> dict:
    """Replay device ``device``'s trace: allocated and reserved over time, the peak, and
    free space and fragmentation at the peak (rebuilt from the end state, module docstring).
    """
    trace, alloc, res, (a0, r0) = _curves(snap, device)
    out = {"device": device, "entries": len(trace), "start": {"allocated_bytes": a0, "reserved_bytes": r0},
           "peak": None, "timeline": [], "max_reserved_bytes": max(res, default=r0),
           "ooms": [{"index": k, "time_us": e.get("time_us"), "size": e.get("size"),
                     "device_free": e.get("device_free")} for k, e in enumerate(trace) if e["action"] == "oom"]}
    if not trace:
        return out
    i = max(range(len(alloc)), key=alloc.__getitem__)
    state = _state_at(snap, device, trace, i)
    out["peak"] = {"index": i, "time_us": trace[i].get("time_us"), "allocated_bytes": alloc[i],
                   "reserved_bytes": res[i], **state,
                   "fragmentation": _fragmentation(state["largest_free_bytes"], state["free_bytes"]),
                   "location": _user_frame(frame_tuple(trace[i].get("frames")))}
    step = max(1, len(trace) // max(points, 1))
    keep = sorted(set(range(0, len(trace), step)) | {i, len(trace) - 1, res.index(max(res))})
    out["timeline"] = [{"index": k, "time_us": trace[k].get("time_us"), "action": trace[k]["action"],
                        "allocated_bytes": alloc[k], "reserved_bytes": res[k]} for k in keep]
    return out


def _state_at(snap, device, trace, i) -> dict:
    live, spans = {}, []
    for s in snap["segments"]:
        if s.get("device", 0) != device or s.get("address") is None:
            continue
        x = bool(s.get("is_expandable"))
        spans.append((s["address"], s["address"] + s["total_size"], x))
        addr = s["address"]
        for b in s["blocks"]:
            addr = b.get("address", addr)
            if b["state"].startswith("active"):
                live[addr] = b["size"]
            addr += b["size"]
    free = _free_action(trace)
    for e in reversed(trace[i + 1:]):           # undo everything after the peak
        act, a, n = e["action"], e.get("addr"), e.get("size", 0)
        if act == "alloc":
            live.pop(a, None)
        elif act == free:
            live[a] = -(-n // _BLOCK_ROUND) * _BLOCK_ROUND
        elif act in SEG_ADD:
            spans = [p for s0, s1, x in spans for p in ((s0, min(s1, a), x), (max(s0, a + n), s1, x)) if p[0] < p[1]]
        elif act in SEG_SUB:
            spans.append((a, a + n, act == "segment_unmap"))
    merged = []                                 # expandable ranges mapped piecewise are one range
    for s0, s1, x in sorted(spans):
        if merged and x and merged[-1][2] and merged[-1][1] == s0:
            merged[-1] = (merged[-1][0], s1, x)
        else:
            merged.append((s0, s1, x))
    allocs, gaps, j = sorted(live.items()), [], 0
    for s0, s1, _ in merged:
        cur = s0
        while j < len(allocs) and allocs[j][0] < s1:
            a, n = allocs[j]
            if a > cur:
                gaps.append(a - cur)
            cur = max(cur, a + n)
            j += 1
        if s1 > cur:
            gaps.append(s1 - cur)
    return {"free_bytes": sum(gaps), "free_blocks": len(gaps), "largest_free_bytes": max(gaps, default=0),
            "segments": len(merged)}


def _positions(trace, marks) -> list:
    """Trace positions of marks: an int or {"index": i} is a position; {"time_us": t} is the
    first event at or after t."""
    times = None
    out = []
    for m in marks:
        if _isint(m) or "index" in m:
            out.append(int(m if _isint(m) else m["index"]))
            continue
        if times is None:
            if any("time_us" not in e for e in trace):
                raise ValueError("marks give time_us but the trace events have none (torch < 2.1?); "
                                 "give each mark an 'index' into the device trace instead")
            times = [e["time_us"] for e in trace]
        out.append(bisect.bisect_left(times, m["time_us"]))
    if any(b < a for a, b in zip(out, out[1:])):
        raise ValueError("marks must be sorted by time (or index), oldest first")
    return out


def _free_at(trace) -> dict:
    """Alloc event index -> index of the event that freed it (absent: never freed)."""
    free, open_, out = _free_action(trace), {}, {}
    for k, e in enumerate(trace):
        if e["action"] == "alloc":
            open_[e["addr"]] = k
        elif e["action"] == free and e["addr"] in open_:
            out[open_.pop(e["addr"])] = k
    return out


def never_freed(snap, device=None, *, steps=None, top: int = 10) -> dict:
    """Allocations in the trace with no free before it ends (leak candidates), by stack.

    ``steps``: step starts, oldest first, as trace indices or marks (``{"index": i}`` or
    ``{"time_us": t}``); step k runs to the next start (the last to the end of the trace).
    With steps, ``steps`` in the result gives, per step, the bytes its allocations still
    hold at the end: a leak shows as every middle step retaining bytes.
    """
    trace = _trace(snap, device)
    freed = _free_at(trace)
    idx = [k for k, e in enumerate(trace) if e["action"] == "alloc" and k not in freed]
    out = {"count": len(idx), "bytes": sum(trace[k]["size"] for k in idx),
           "groups": top_groups(((trace[k]["size"], trace[k]["size"], frame_tuple(trace[k].get("frames"))) for k in idx), top)}
    if steps:
        starts = _positions(trace, steps)
        ends = starts[1:] + [len(trace)]
        out["steps"] = []
        for n, (a, b) in enumerate(zip(starts, ends)):
            kept = [k for k in idx if a <= k < b]
            big = max(kept, key=lambda k: trace[k]["size"], default=None)
            out["steps"].append({"step": n, "start_index": a, "end_index": b,
                                 "retained_bytes": sum(trace[k]["size"] for k in kept),
                                 "retained_count": len(kept), "location": None if big is None
                                 else _user_frame(frame_tuple(trace[big].get("frames")))})
    return out


# -- joining the allocator's events to the tracer's marks ------------------------------------
_KEEPS = {"forward": "activations", "recompute": "activations", "backward": "gradients",
          "optimizer": "optimizer_state", "other": "temporaries"}


def join(events, marks, *, device=None) -> list:
    """Attribute each ``alloc`` event to the module, phase and category active when it ran.

    ``events``: a snapshot dict (its device ``device``, default the longest trace) or one
    device's list of trace events. ``marks``: a list of dicts, oldest first; each opens an
    interval that lasts until the next mark::

        {"time_us": int,        # host wall clock, us since the Unix epoch: time.time_ns() // 1000
         # or "index": int,     # position in the device trace, when the emitter knows it
         "module": str | None,  # named_modules() name of the innermost module running
                                #   ("" the root, None outside every module)
         "phase": "forward" | "backward" | "recompute" | "optimizer" | "other" | None,
         "category": str}       # optional: forces the category of the interval's allocations

    Emit one at every module entry and exit (the module now innermost) and every phase
    change. Without "category", an allocation freed before its phase ends is
    ``temporaries``; one that outlives it is ``activations`` (forward, recompute),
    ``gradients`` (backward) or ``optimizer_state``; outside any phase ``unknown``.
    Returns one dict per alloc: index, time_us, addr, size, module, phase, category,
    freed_index (None: never freed), location (innermost frame outside torch).
    """
    trace, marks = _trace(events, device), [m if isinstance(m, dict) else {"index": m} for m in marks]
    pos = _positions(trace, marks)
    phase_end, nxt = [len(trace)] * len(marks), len(trace)
    for k in range(len(marks) - 1, -1, -1):     # where each mark's phase gives way to another
        if k + 1 < len(marks) and marks[k + 1].get("phase") != marks[k].get("phase"):
            nxt = pos[k + 1]
        phase_end[k] = nxt
    freed, rows, k = _free_at(trace), [], -1
    for i, e in enumerate(trace):
        while k + 1 < len(marks) and pos[k + 1] <= i:
            k += 1
        if e["action"] != "alloc":
            continue
        m = marks[k] if k >= 0 else {}
        f, phase = freed.get(i), m.get("phase")
        cat = m.get("category") or ("temporaries" if f is not None and k >= 0 and f < phase_end[k]
                                     else _KEEPS.get(phase, "unknown"))
        rows.append({"index": i, "time_us": e.get("time_us"), "addr": e["addr"], "size": e["size"],
                     "module": m.get("module"), "phase": phase, "category": cat, "freed_index": f,
                     "location": _user_frame(frame_tuple(e.get("frames")))})
    return rows


def module_peaks(snap: dict, marks, device: int = 0) -> list:
    """Peak allocated bytes while each module ran, from the allocator (compare with the
    tracer's per-module ``peak_bytes``). ``inclusive`` also counts its submodules' intervals
    (by ``named_modules()`` prefix). Marks as in :func:`join`."""
    trace, alloc, _, _ = _curves(snap, device)
    marks = [m if isinstance(m, dict) else {"index": m} for m in marks]
    pos = _positions(trace, marks) + [len(trace)]
    own: dict = {}
    for k, m in enumerate(marks):
        if pos[k] < pos[k + 1] and m.get("module") is not None:
            own[m["module"]] = max(own.get(m["module"], 0), max(alloc[pos[k]:pos[k + 1]]))
    incl = dict(own)
    for name, peak in own.items():
        parts = name.split(".") if name else []
        for p in [""] + [".".join(parts[:n]) for n in range(1, len(parts))]:
            incl[p] = max(incl.get(p, 0), peak)
    return [{"module": n, "peak_allocated_bytes": own.get(n), "inclusive_peak_allocated_bytes": v}
            for n, v in sorted(incl.items())]
