"""CUDA caching-allocator snapshots: load them safely, summarise, replay, join, check.

A snapshot is what ``torch.cuda.memory._snapshot()`` returns and ``_dump_snapshot()``
pickles (the file pytorch.org/memory_viz opens). It holds only dicts, lists, tuples, str,
int, float, bool and None::

    {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
                   "requested_size", "stream", "segment_type": "large"|"small", "is_expandable",
                   "blocks": [{"address", "size", "requested_size", "frames",
                               "state": "active_allocated"|"active_pending_free"|"inactive"}]}],
     "device_traces": [[{"action", "addr", "size", "stream", "frames", "time_us"}, ...]],
     "allocator_settings": {...}}

``device_traces[d]`` lists device ``d``'s events oldest first: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``/``segment_free`` (cudaMalloc/cudaFree),
``segment_map``/``segment_unmap`` (expandable segments), ``snapshot``, ``oom``. Event sizes
are requested bytes; ``time_us`` is host wall-clock time, microseconds since the Unix epoch
(the clock of ``time.time_ns() // 1000``). Frames are innermost first, ``{"filename",
"line", "name"}``. Everything here is pure Python over that dict (no torch).

    >>> snap = load_snapshot("step.pickle")        # refuses any pickle that would run code
    >>> s = summarize_snapshot(snap, top=5)
    >>> s["reserved_bytes"], s["allocated_bytes"], s["fragmentation"]

The history (:func:`replay`, :func:`never_freed`, :func:`join`, :func:`module_peaks`) is in
:mod:`.snapshot_history`, with its own limitations; every name is importable from here.

:func:`load_snapshot` checks what it reads against that format (:mod:`.snapshot_format`:
types and ranges of every field the summaries read, frames, ``allocator_settings``) and
bounds the work by the file's size, so a malformed or crafted file is one ``SnapshotError``
line, never a traceback or a run that does not end.

Known limitations:
  - the legacy format (a bare list of segments, no traces) is accepted; it has no history.
  - the other functions trust their input (a dict from ``torch.cuda.memory._snapshot()`` in
    this process, or from :func:`load_snapshot`); pass any other dict through
    ``validate_snapshot`` first.
"""
from __future__ import annotations

import io
import os
import pickle

from ..inputs import SNAPSHOT_MAX_BYTES, InputFileError, read_input
from ..record import Finding
from .snapshot_format import NODES_BASE, NODES_PER_BYTE, validate_snapshot
from .snapshot_history import (ALLOCATED, segment_figures, frame_tuple, top_groups, join, module_peaks,
                               never_freed, replay)

__all__ = ["allocator_view", "SnapshotError", "load_snapshot", "validate_snapshot", "summarize_snapshot", "replay",
           "never_freed", "join", "module_peaks", "check_snapshot", "DEFAULT_OPTIONS"]

_PLAIN = "dicts, lists, tuples, strings, numbers, booleans and None"
_MAKE = "torch.cuda.memory._dump_snapshot(path)"

#: Thresholds of :func:`check_snapshot`; override any of them through ``options``.
DEFAULT_OPTIONS = {
    "fragmentation": 0.3,          # 1 - largest free block / free bytes, at or above this
    "reserved_ratio": 1.5,         # reserved at least this many times allocated
    "min_free_bytes": 64 * 2**20,  # ignore fragmentation of less cached free memory
    "leak_min_bytes": 1,           # retained bytes per step that count as growth
}


class SnapshotError(ValueError):
    """The input is not a usable CUDA memory snapshot; the message is one line."""


class _Refused(Exception):
    pass


class _SnapshotUnpickler(pickle.Unpickler):
    # Every callable a pickle can invoke is first looked up here (GLOBAL, STACK_GLOBAL, INST,
    # OBJ, EXT*), before REDUCE/NEWOBJ/BUILD can call it. A snapshot names none, so refusing
    # every name means nothing in the file can run.
    def find_class(self, module, name):
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("a persistent id (torch.save storage)")


def load_snapshot(source) -> dict:
    """Read a snapshot from a path, bytes or a binary file object, refusing anything else.

    Any global the pickle names (``os.system``, ``builtins.eval``, a class...) is refused
    before it can be called. Raises :class:`SnapshotError` for unreadable, truncated, non-
    pickle, refused or wrongly shaped input. Returns the snapshot dict (a legacy list of
    segments comes back as ``{"segments": [...], "device_traces": []}``).
    """
    name, data = _read(source)
    head = data[:8].lstrip()
    if not data:
        raise SnapshotError(f"{name} is empty; expected a pickle written by {_MAKE}")
    if data[:4] == b"PK\x03\x04":
        raise SnapshotError(f"{name} is a zip archive (torch.save writes those), not a memory "
                            f"snapshot; write one with {_MAKE}")
    if data[:2] == b"\x1f\x8b":
        raise SnapshotError(f"{name} is gzip-compressed; decompress it first (gunzip)")
    try:
        obj = _SnapshotUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise SnapshotError(f"refused {name}: the pickle names {e}, which a CUDA memory snapshot "
                            f"never contains (snapshots hold only {_PLAIN}); nothing in it was "
                            f"run") from None
    except Exception as e:
        hint = " (it is JSON: a torchledger record? use `torchledger report`)" if _is_json(head, data) else ""
        why = " ".join(str(e).split()) or type(e).__name__
        what = "is a truncated pickle" if isinstance(e, EOFError) or "truncated" in why else "is not a valid pickle"
        raise SnapshotError(f"{name} {what} ({why}){hint}; expected a file written by {_MAKE}") from None
    # NB: every reference to a shared object counts in full: a small file cannot stand for a
    # huge snapshot ("billion laughs"); see snapshot_format's docstring for the budget
    return validate_snapshot(obj, error=SnapshotError, name=name,
                             budget=NODES_BASE + NODES_PER_BYTE * len(data))


def _is_json(head: bytes, data: bytes) -> bool:
    if head[:1] not in (b"{", b"[") or len(data) > 2**26:
        return False
    try:
        import json
        json.loads(data)
        return True
    except ValueError:
        return False


def _read(source):
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "<bytes>", bytes(source)
    if hasattr(source, "read"):
        data = source.read(SNAPSHOT_MAX_BYTES + 1)
        name = str(getattr(source, "name", "<stream>"))
        if len(data) > SNAPSHOT_MAX_BYTES:
            raise SnapshotError(f"{name}: larger than {SNAPSHOT_MAX_BYTES >> 20} MiB; expected a "
                                f"CUDA memory snapshot of at most that size")
        return name, data
    path = os.fspath(source)
    try:        # a regular file of bounded size: a FIFO or /dev/zero is refused, never read
        return path, read_input(path, what="CUDA memory snapshot", max_bytes=SNAPSHOT_MAX_BYTES)
    except InputFileError as e:
        raise SnapshotError(f"cannot read {e}") from None


# -- the end state -------------------------------------------------------------------------
def summarize_snapshot(snap: dict, top: int = 10, *, device=None, steps=None) -> dict:
    """Figures of the end state, per device and stream, top stacks, and the replayed history.

    ``allocated_bytes`` is the requested bytes of ``active_allocated`` blocks,
    ``allocated_block_bytes`` their rounded sizes (what ``torch.cuda.memory_allocated``
    reports), ``free_bytes`` the inactive blocks cached in segments and ``fragmentation``
    ``1 - largest_free_bytes / free_bytes``. ``history`` has one entry per device with a
    trace: :func:`replay` plus :func:`never_freed` (``steps``: step starts, see there).
    """
    segs = [s for s in snap["segments"] if device is None or s.get("device", 0) == device]
    out = {"schema": "torchledger.snapshot/1", **segment_figures(segs)}
    by_device: dict = {}                        # NB: grouped once, so that the work per device
    keyed: dict = {}                            # and stream stays linear in the segments
    for s in segs:
        by_device.setdefault(s.get("device", 0), []).append(s)
        keyed.setdefault((s.get("device", 0), s.get("stream", 0)), []).append(s)
    out["devices"] = [{"device": d, **segment_figures(by_device[d])} for d in sorted(by_device)]
    out["streams"] = [{"device": d, "stream": st, **segment_figures(ss)} for (d, st), ss in sorted(keyed.items())]
    out["segment_types"] = {t: sum(1 for s in segs if s.get("segment_type", "large") == t)
                            for t in ("large", "small")}
    out["top_allocations"] = top_groups(((b["size"], b.get("requested_size", b["size"]), frame_tuple(b.get("frames")))
                                     for s in segs for b in s["blocks"] if b["state"] == ALLOCATED), top)
    out["history"] = []
    for d, trace in enumerate(snap.get("device_traces", [])):
        if trace and (device is None or d == device):
            one = {**snap, "segments": by_device.get(d, [])}      # this device's segments only
            out["history"].append({**replay(one, d), "never_freed": never_freed(one, d, steps=steps, top=top)})
    out["allocator_settings"] = snap.get("allocator_settings") or {}
    return out

# -- findings ------------------------------------------------------------------------------
def allocator_view(allocator: dict, snap, marks, device) -> dict:
    """A traced step's ``memory["allocator"]`` with the snapshot read: its summary (top 5) and
    the peak per module between the tracer's ``marks``; ``allocator`` unchanged when the history
    was not recorded, and a reason instead when the snapshot cannot be read."""
    if not allocator.get("available") or snap is None:
        return allocator
    try:
        summary = summarize_snapshot(snap, top=5, device=device)
        peaks = module_peaks(snap, marks or [], device=device)
    except Exception as e:  # noqa: BLE001
        return {"available": False, "reason": f"allocator snapshot failed: {type(e).__name__}: {e}"}
    return {"available": True, "summary": summary, "module_peaks": peaks,
            "notes": list(allocator.get("notes", []))}


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_snapshot(summary: dict, options=None) -> list:
    """TL-CUDA-001 (warning) fragmentation: reserved >> allocated and no large free block,
    now or at the peak. TL-CUDA-002: allocations never freed; a warning when every middle
    step (of 3 or more) retains bytes to the end, info otherwise."""
    o = {**DEFAULT_OPTIONS, **(options or {})}
    out = []
    cases = [("at the end", summary)] + [(f"at the peak (device {h['device']}, event {h['peak']['index']})",
                                          h["peak"]) for h in summary.get("history", []) if h.get("peak")]
    hits = [(w, c) for w, c in cases if c["fragmentation"] >= o["fragmentation"]
            and c["free_bytes"] >= o["min_free_bytes"]
            and c["reserved_bytes"] >= o["reserved_ratio"] * max(c["allocated_bytes"], 1)]
    if hits:
        w, c = max(hits, key=lambda h: h[1]["free_bytes"] * h[1]["fragmentation"])
        out.append(Finding(
            "TL-CUDA-001", "warning",
            f"fragmentation {w}: {_gib(c['reserved_bytes'])} reserved for {_gib(c['allocated_bytes'])} "
            f"allocated; {_gib(c['free_bytes'])} is cached free in {c['free_blocks']} blocks but the "
            f"largest is {_gib(c['largest_free_bytes'])} (fragmentation {c['fragmentation']:.2f}), so a "
            f"larger tensor needs a new cudaMalloc and can OOM with memory 'free'",
            measured=round(c["fragmentation"], 4), expected=f"< {o['fragmentation']}",
            hint="set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, keep tensor shapes the same "
                 "from step to step, and free large temporaries before allocating others"))
    for h in summary.get("history", []):
        nf = h["never_freed"]
        steps = nf.get("steps") or []
        middle = steps[1:-1]
        where = nf["groups"][0]["location"] if nf["groups"] else None
        if len(steps) >= 3 and all(s["retained_bytes"] >= o["leak_min_bytes"] for s in middle):
            per = sorted(s["retained_bytes"] for s in middle)[len(middle) // 2]
            where = max((s["location"] for s in middle), key=[s["location"] for s in middle].count)
            out.append(Finding(
                "TL-CUDA-002", "warning",
                f"memory grows step after step on device {h['device']}: each of steps 1-{len(steps) - 2} "
                f"kept allocations alive to the end of the trace (median {per:,} bytes per step)",
                location=where, measured=[s["retained_bytes"] for s in steps],
                hint="store loss.item() rather than loss; .detach() tensors kept across steps; "
                     "zero_grad(set_to_none=True)"))
        elif nf["count"] and nf["bytes"] >= o["leak_min_bytes"]:
            out.append(Finding(
                "TL-CUDA-002", "info",
                f"{nf['count']} allocation(s) ({nf['bytes']:,} bytes) made during the recording on "
                f"device {h['device']} were never freed: leak candidates, or state kept on purpose "
                f"(optimizer state, gradients, outputs)", location=where, measured=nf["bytes"],
                hint="record 3 or more steps and pass their starts (steps=...) to tell growth "
                     "from one-off state"))
    return out
