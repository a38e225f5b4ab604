"""Checking an unpickled CUDA memory snapshot against the allocator's format, in bounded work.

The format is the dict ``torch.cuda.memory._snapshot()`` returns (its docstring has the
TypedDicts; :mod:`.snapshot` summarises them). :func:`validate_snapshot` walks it once and
returns a clean copy in which every field the summaries read has the type and range the
allocator writes (sizes and addresses are ``size_t``, streams ``cudaStream_t``, frames
``{"filename": str, "line": int, "name": str}``, ``allocator_settings`` a shallow dict of plain
values), so nothing downstream can meet a list where an int belongs. Anything else raises
``SnapshotError`` naming the place (``segments[3].blocks[0].size``).

A pickle can share one object many times for two bytes a reference: a segment list of a
thousand references to one segment of a thousand references to one block is six kilobytes
that read as a billion blocks. Each object is checked once (remembered by identity), but every
reference is charged the size of what it holds, as the summaries will visit it that often;
past ``budget`` nodes the file is refused. ``load_snapshot`` sets the budget from the file's
size: ``NODES_BASE + NODES_PER_BYTE * len(data)``. Every distinct node costs at least one
opcode byte, and the sharing a PyTorch snapshot can hold (we take it to be one traceback list
for a block and its alloc and free events, frame dicts shared between tracebacks) stays far
below the budget:
0.03-0.06 nodes a byte for tests/data/snapshots, 0.48 for a 0.8 MB trace in which every
allocation shares a 150-frame traceback with its block and free event (measured by
tests/test_hostile_snapshots.py), against 32 allowed.

Known limitations: keys this module does not know are kept as they are, unchecked, for the
caller's use; nothing here reads them.
"""
from __future__ import annotations

import math

__all__ = ["validate_snapshot", "NODES_BASE", "NODES_PER_BYTE", "STATES", "MAX_DEVICES"]

#: Work allowed per input byte, and for any file, in nodes visited (see the module docstring).
NODES_PER_BYTE = 32
NODES_BASE = 1_000_000
#: Block states the allocator writes (torch documents ``active_awaiting_free``; it writes
#: ``active_pending_free``).
STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")
#: One trace per CUDA device of the machine; each is summarised on its own (a history section).
MAX_DEVICES = 1024
_SETTINGS_DEPTH = 3                 # allocator_settings: {"roundup_power2_divisions": {...}} at most
_U64 = 2**64
_I64 = 2**63
_MAKE = "torch.cuda.memory._dump_snapshot(path)"


class _Check:
    """One walk: the error type, the file's name, the budget and the identity memo."""

    def __init__(self, error, name: str, budget):
        self.error, self.name, self.budget = error, name, budget
        self.nodes, self.memo = 0, {}

    def fail(self, where: str, expected: str, got, shown=None) -> None:
        raise self.error(f"{self.name}: {where} is {shown or _show(got)}; expected {expected} (a CUDA memory "
                         f"snapshot as {_MAKE} writes it)")

    def charge(self, n: int) -> None:
        self.nodes += n
        if self.budget is not None and self.nodes > self.budget:
            raise self.error(
                f"{self.name}: reading it would visit more than {self.budget:,} nodes, more than "
                f"any snapshot of its size holds (it shares objects so that a few bytes stand for "
                f"many: a 'billion laughs' pickle); refused unread. Expected a file written by {_MAKE}")

    def once(self, obj, where: str, check, kind):
        """``check(obj, where) -> (clean, own_cost)``, run once per object (by identity) and
        ``kind`` (one dict may be shared as a segment and as a block); its first use is
        charged as it runs, every later use the whole cost again."""
        key = (id(obj), kind)
        hit = self.memo.get(key)
        if hit is None:
            self.memo[key] = (None, None, obj)          # NB: a cycle meets this marker
            n0 = self.nodes
            clean, own = check(obj, where)
            self.charge(own)
            self.memo[key] = (clean, self.nodes - n0, obj)   # obj kept alive: ids stay unique
            return clean
        if hit[1] is None:
            self.fail(where, "a value that does not contain itself", None, "a reference to a value "
                      "that contains it")
        self.charge(hit[1])
        return hit[0]


def _show(x) -> str:
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, int):
        return f"an int of {len(str(abs(x))) if abs(x) < 10**100 else 'over 100'} digits" \
            if abs(x) >= _U64 else f"the int {x}"
    if isinstance(x, str):
        return f"the string {_clean(x)[:40]!r}"
    return f"a {type(x).__name__}"


def _clean(s: str) -> str:
    """The string, with any lone surrogate (not encodable as UTF-8) written as ``\\udXXX``."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _int(c: _Check, x, where: str, lo: int, hi: int, what: str):
    if not (isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi):
        c.fail(where, what, x)
    return x


def _u64(c, x, where):
    return _int(c, x, where, 0, _U64, "an int in [0, 2**64)")


def _str(c, x, where):
    if not isinstance(x, str):
        c.fail(where, "a string", x)
    return _clean(x)


def _fields(c: _Check, d: dict, where: str, spec: dict, required=()) -> dict:
    """``{**d, key: checked}`` for each key of ``spec`` present; an optional key holding None
    is dropped (read as absent, so ``.get(key, default)`` downstream gets the default)."""
    for key in required:
        if key not in d:
            keys = ", ".join(repr(_clean(k)) if isinstance(k, str) else _show(k) for k in list(d)[:6])
            c.fail(f"{where} (keys {keys or 'none'})", f"a dict with {key!r}", d)
    out = dict(d)
    for key, check in spec.items():
        if key not in d:
            continue
        if d[key] is None and key not in required:
            del out[key]
        else:
            out[key] = check(c, d[key], f"{where}.{key}")
    return out


# -- frames --------------------------------------------------------------------------------
def _frame(c: _Check, f, where: str):
    if not isinstance(f, dict):
        c.fail(where, "a frame dict {'filename', 'line', 'name'}", f)
    out = _fields(c, f, where, {"filename": _str, "name": _str,
                                "line": lambda c, x, w: _int(c, x, w, -_I64, _I64, "an int")},
                  required=("filename", "line", "name"))
    # NB: summaries format every use of a frame: long names cost more than one node
    return out, 1 + (len(out["filename"]) + len(out["name"])) // 256


def _frames(c: _Check, frames, where: str):
    if not isinstance(frames, (list, tuple)):
        c.fail(where, "a list of frames", frames)
    return [c.once(f, f"{where}[{k}]", lambda f, w: _frame(c, f, w), _frame)
            for k, f in enumerate(frames)], 1


def _frames_field(c, frames, where):
    return c.once(frames, where, lambda f, w: _frames(c, f, w), _frames)


# -- segments and blocks ---------------------------------------------------------------------
def _state(c, x, where):
    if x not in STATES:
        c.fail(where, f"one of {', '.join(STATES)}", x)
    return x


def _bool(c, x, where):
    if not isinstance(x, bool):
        c.fail(where, "True or False", x)
    return x


def _block(c: _Check, b, where: str):
    if not isinstance(b, dict):
        c.fail(where, "a block dict with 'size' and 'state'", b)
    return _fields(c, b, where, {"size": _u64, "requested_size": _u64, "address": _u64,
                                 "state": _state, "frames": _frames_field},
                   required=("size", "state")), 1


def _segment(c: _Check, s, where: str):
    if not isinstance(s, dict):
        c.fail(where, "a segment dict with 'total_size' and 'blocks'", s)
    out = _fields(c, s, where, {"total_size": _u64, "address": _u64, "device": _device,
                                "stream": _u64, "segment_type": _str, "is_expandable": _bool,
                                "frames": _frames_field}, required=("total_size", "blocks"))
    out["blocks"] = _list(c, s["blocks"], f"{where}.blocks", _block, "a list of blocks")
    return out, 1


def _device(c, x, where):
    return _int(c, x, where, 0, 2**31, "a device index, an int in [0, 2**31)")


def _items(c: _Check, xs, where: str, item, what: str):
    if not isinstance(xs, list):
        c.fail(where, what, xs)
    return [c.once(x, f"{where}[{k}]", lambda x, w: item(c, x, w), item) if isinstance(x, (dict, list))
            else item(c, x, f"{where}[{k}]")[0] for k, x in enumerate(xs)], 1


def _list(c: _Check, xs, where: str, item, what: str) -> list:
    return c.once(xs, where, lambda xs, w: _items(c, xs, w, item, what), (_items, item)) \
        if isinstance(xs, list) \
        else _items(c, xs, where, item, what)[0]


# -- device traces -------------------------------------------------------------------------
_SIZED = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
          "segment_map", "segment_unmap"}


def _event(c: _Check, e, where: str):
    if not isinstance(e, dict) or not isinstance(e.get("action"), str):
        c.fail(where, "an event dict with 'action' (a string)", e)
    sized = e["action"] in _SIZED
    return _fields(c, e, where, {"action": _str, "addr": _u64, "size": _u64, "stream": _u64,
                                 "device_free": _u64, "frames": _frames_field,
                                 "time_us": lambda c, x, w: _int(c, x, w, 0, _I64, "an int in [0, 2**63)")},
                   required=("addr", "size") if sized else ()), 1


def _trace(c: _Check, t, where: str):
    return _items(c, t, where, _event, "a list of events")


# -- allocator settings ----------------------------------------------------------------------
def _settings(c: _Check, x, where: str, depth: int):
    if isinstance(x, dict):
        return {_str(c, k, f"{where} key"): _setting(c, v, f"{where}[{k[:40]!r}]", depth + 1)
                for k, v in x.items()}
    return [_setting(c, v, f"{where}[{k}]", depth + 1) for k, v in enumerate(x)]


def _setting(c: _Check, x, where: str, depth: int = 0):
    c.charge(1)
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, int):
        return _int(c, x, where, -_U64, _U64, "an int in (-2**64, 2**64)")
    if isinstance(x, float):
        if not math.isfinite(x):
            c.fail(where, "a finite number", x)
        return x
    if isinstance(x, str):
        return _clean(x)
    if isinstance(x, (dict, list, tuple)) and depth < _SETTINGS_DEPTH:
        return c.once(x, where, lambda x, w: (_settings(c, x, w, depth), 0), _settings)
    c.fail(where, f"a plain value (None, bool, number, string, or lists and dicts of them "
                  f"nested at most {_SETTINGS_DEPTH} deep)", x)


# -- the snapshot ----------------------------------------------------------------------------
def validate_snapshot(obj, *, error=ValueError, name: str = "snapshot", budget=None) -> dict:
    """A checked copy of ``obj`` (see the module docstring), or ``error`` with one line.

    ``budget``: the most nodes to visit, counting every reference to a shared object in
    full; ``None``, no limit (for a snapshot taken in this process).
    """
    c = _Check(error, name, budget)
    if isinstance(obj, list) and obj and all(isinstance(s, dict) and "blocks" in s for s in obj):
        obj = {"segments": obj, "device_traces": []}      # legacy: a bare list of segments
    want = "a dict with 'segments' and 'device_traces', as torch.cuda.memory._snapshot() returns"
    if not isinstance(obj, dict):
        raise error(f"{name} holds a {type(obj).__name__}; expected {want}")
    if "segments" not in obj:
        keys = ", ".join(repr(_clean(k)) if isinstance(k, str) else _show(k) for k in list(obj)[:6])
        raise error(f"{name} has no 'segments' key (keys: {keys or 'none'}); expected {want}")
    traces = obj.get("device_traces", [])
    if not isinstance(obj["segments"], list) or not isinstance(traces, list):
        raise error(f"{name}: 'segments' and 'device_traces' must be lists; expected {want}")
    if len(traces) > MAX_DEVICES:
        raise error(f"{name}: 'device_traces' holds {len(traces):,} traces; expected one per CUDA "
                    f"device, at most {MAX_DEVICES:,}")
    out = dict(obj)
    out["segments"] = _list(c, obj["segments"], "segments", _segment, "a list of segments")
    out["device_traces"] = _list(c, traces, "device_traces", _trace, "a list of event lists")
    if obj.get("allocator_settings") is not None:
        if not isinstance(obj["allocator_settings"], dict):
            c.fail("allocator_settings", "a dict", obj["allocator_settings"])
        out["allocator_settings"] = _setting(c, obj["allocator_settings"], "allocator_settings")
    return out
