"""Validation of saved records: once, at load, before anything renders or compares them.

A record read back from a file is user input. :func:`parse_record` turns its text into plain
data in bounded work (nesting checked before ``json`` recurses; ``NaN``/``Infinity``, numbers
past int64 or float range, and lone surrogates refused) and :func:`check_record` holds it to
the shape ``StepRecord.to_dict()`` writes: the fields the renderers and the baseline gate read
have their types and ranges; fields that older records lack are simply absent (readers use
``.get(key, default)``); keys this version does not know are kept, bounded like the rest.
Every refusal is one :class:`RecordError` line naming the field, what was expected and what
arrived:

    totals.flops.total: expected a whole number from 0 to 2**63-1, got -5

Known limitations: fields only the analyzers read (``memory.retained``, ``optimizer.state``)
are bounded but not typed field by field; ``report`` runs no analyzer.
"""
from __future__ import annotations

import itertools
import json
import math
import re

__all__ = ["RecordError", "parse_record", "check_record", "MAX_DEPTH", "MAX_STRING", "MAX_INT"]

#: Deepest nesting of objects and lists; ``to_dict()`` writes 5 (meta.config may add a few).
MAX_DEPTH = 32
#: Longest string, in characters: messages and tracebacks in warnings stay far below.
MAX_STRING = 1 << 20
#: Counts, FLOPs and bytes: the tracer sums them in int64.
MAX_INT = 2**63 - 1
#: Module depth: named_modules() recurses, so deeper trees cannot be traced.
MAX_MODULE_DEPTH = 1000


class RecordError(ValueError):
    """A record that cannot be read as one: the message is one line."""


# -- parsing --------------------------------------------------------------------------------
class _Bad:
    """A JSON number or constant that parsed but is no record value (reported with its path)."""

    def __init__(self, text: str):
        self.text = text

    @property
    def expected(self) -> str:
        if re.fullmatch(r"-?[0-9]+", self.text):
            return "a whole number within int64 (at most 2**63-1)"
        return "a finite number (JSON has no NaN or Infinity)"

    def __repr__(self):
        s = self.text
        digits = sum(c.isdigit() for c in s)
        return f"a {digits}-digit number" if len(s) > 24 else s


def _parse_int(s: str):
    if len(s.lstrip("-")) > 19:                 # never build a 4,000-digit int
        return _Bad(s)
    n = int(s)
    return n if -MAX_INT - 1 <= n <= MAX_INT else _Bad(s)


def _parse_float(s: str):
    if len(s) > 400:
        return _Bad(s)
    x = float(s)
    return x if math.isfinite(x) else _Bad(s)


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


#: Outside strings, what could parse to a value past int64 or to inf/nan: 19+ digits, a
#: 3-digit exponent, NaN, Infinity (valid JSON has no other capital letter there).
_RISKY_NUMBER = re.compile(r"[0-9]{19}|[eE][+-]?[0-9]{3}|[NI]")
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_nesting(bare: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` before ``json`` recurses into it: the
    brackets of ``bare`` (the text with its strings removed), summed in C."""
    brackets = _NOT_BRACKETS.sub("", bare)
    depth = max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)
    if depth > MAX_DEPTH:
        raise RecordError(f"nested {depth} levels deep; expected at most {MAX_DEPTH} (a record as "
                          f"torchledger writes it has 5)")


def _may_hold_surrogate(text: str) -> bool:
    if "\\u" in text and _ESCAPED_SURROGATE.search(text):
        return True
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
    return False


def parse_record(text) -> object:
    """The JSON value in ``text`` (str or UTF-8 bytes), every value bounded and plain.

    Nesting is checked before ``json`` recurses. Where a number could be NaN, Infinity or
    past int64 or float range, it parses to a placeholder that the walk over every value
    refuses with its path; the walk runs only when the text could hold something to refuse
    (a placeholder, a ``\\uD8xx`` escape, a string longer than :data:`MAX_STRING`), so a
    plain record costs about what ``json.loads`` does."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(f"not UTF-8 text (byte {e.start}); expected a JSON record") from None
    bare = _STRINGS.sub("", text)
    _check_nesting(bare)
    bad = []

    def hook(parse):
        def parse_one(s):
            value = parse(s)
            if isinstance(value, _Bad):
                bad.append(value)
            return value
        return parse_one

    hooks = {}
    if _RISKY_NUMBER.search(bare):
        hooks = dict(parse_int=hook(_parse_int), parse_float=hook(_parse_float), parse_constant=hook(_Bad))
    try:
        data = json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:                      # not reached past _check_nesting; kept as a guard
        raise RecordError(f"nested deeper than {MAX_DEPTH} levels") from None
    if bad or len(text) > MAX_STRING or _may_hold_surrogate(text):
        _check_values(data)
    return data


# -- every value: bounded and plain ---------------------------------------------------------
def _where(path: tuple) -> str:
    """``("modules", 3, "name")`` -> ``modules[3].name``."""
    out = ""
    for key in path:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            name = key if re.fullmatch(r"[A-Za-z0-9_ ()\-]{1,64}", key) else ascii(key[:40])
            out += f".{name}" if out else name
    return out or "record"


def arrived(value) -> str:
    """What came, for a message: short, one line, never a surrogate."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, _Bad)):
        return repr(value)
    if isinstance(value, str):
        s = value if len(value) <= 40 else value[:37] + "..."
        return "a string " + ascii(s)
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _check_string(s: str, path: tuple, noun: str = "a string") -> None:
    if len(s) > MAX_STRING:
        _refuse(path, f"{noun} of at most {MAX_STRING:,} characters", f"{len(s):,} characters")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            _refuse(path, f"{noun} that UTF-8 can encode", f"a lone surrogate {ascii(s[e.start])}")


def _check_values(data) -> None:
    """Walk ``data`` without recursion: nesting, string sizes and encodability, number ranges."""
    stack = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
        elif value is None or isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if not -MAX_INT - 1 <= value <= MAX_INT:
                _refuse(path, "a whole number within int64 (at most 2**63-1)",
                        repr(_Bad(str(value))) if abs(value) < 10**400 else "a huge number")
        elif isinstance(value, float):
            if not math.isfinite(value):
                _fail(path, "a finite number", value)
        elif isinstance(value, _Bad):
            _fail(path, value.expected, value)
        elif isinstance(value, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                _refuse(path, f"at most {MAX_DEPTH} levels of nesting", "deeper nesting")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        _refuse(path, "string keys", f"a key {arrived(key)}")
                    _check_string(key, path, "a key")
                    stack.append((item, path + (key,), depth + 1))
            else:
                stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))
        else:
            _refuse(path, "a JSON value", type(value).__name__)


def _fail(path: tuple, expected: str, value) -> None:
    """Refuse ``value`` at ``path``."""
    _refuse(path, expected, arrived(value))


def _refuse(path: tuple, expected: str, got: str) -> None:
    err = RecordError(f"{_where(path)}: expected {expected}, got {got}")
    err.path = path
    raise err


# -- the shape of a record ------------------------------------------------------------------
class _Spec:
    describe = "a value"

    def ok(self, value) -> bool:
        return True

    def check(self, value, path: tuple) -> None:
        if not self.ok(value):
            _fail(path, self.describe, value)


class _Count(_Spec):
    def __init__(self, lo: int = 0, hi: int = MAX_INT):
        self.lo, self.hi = lo, hi
        top = "2**63-1" if hi == MAX_INT else f"{hi:,}"
        self.describe = f"a whole number from {lo} to {top}"

    def ok(self, v):
        return isinstance(v, int) and not isinstance(v, bool) and self.lo <= v <= self.hi


class _Real(_Spec):
    def __init__(self, lo=None):
        self.lo = lo
        self.describe = "a number" if lo is None else f"a number >= {lo}"

    def ok(self, v):
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and (self.lo is None or v >= self.lo))


class _Str(_Spec):
    def __init__(self, choices=None):
        self.choices = choices
        self.describe = f"one of {', '.join(choices)}" if choices else "a string"

    def ok(self, v):
        return isinstance(v, str) and (self.choices is None or v in self.choices)


class _Bool(_Spec):
    describe = "true or false"

    def ok(self, v):
        return isinstance(v, bool)


class _Null(_Spec):
    def __init__(self, inner: _Spec):
        self.inner = inner
        self.describe = f"{inner.describe} or null"

    def check(self, value, path):
        if value is not None:
            try:
                self.inner.check(value, path)
            except RecordError as e:        # the wrong type here: say that null would do too
                if getattr(e, "path", None) == path:
                    _fail(path, self.describe, value)
                raise


class _Either(_Spec):
    def __init__(self, *specs: _Spec, describe: str):
        self.specs, self.describe = specs, describe

    def check(self, value, path):
        for spec in self.specs:
            try:
                spec.check(value, path)
                return
            except RecordError:
                continue
        _fail(path, self.describe, value)


class _List(_Spec):
    def __init__(self, item: _Spec):
        self.item = item
        self.describe = "a list"

    def check(self, value, path):
        if not isinstance(value, list):
            _fail(path, self.describe, value)
        for i, v in enumerate(value):
            self.item.check(v, path + (i,))


class _Obj(_Spec):
    """An object whose listed keys have their specs; ``other`` is the spec of the rest."""

    def __init__(self, fields=None, *, other: _Spec | None = None, required=(), after=None):
        self.fields, self.other, self.required, self.after = fields or {}, other, required, after
        self.describe = "an object"

    def check(self, value, path):
        if not isinstance(value, dict):
            _fail(path, self.describe, value)
        for key in self.required:
            if key not in value:
                _refuse(path + (key,), self.fields[key].describe, "nothing (the key is missing)")
        for key, v in value.items():
            spec = self.fields.get(key, self.other)
            if spec is not None:
                spec.check(v, path + (key,))
        if self.after is not None:
            self.after(value, path)


ANY = _Spec()
COUNT = _Count()
REAL = _Real()
NONNEG = _Real(0)
STR = _Str()
OPT_STR = _Null(STR)
OPT_COUNT = _Null(COUNT)
COUNTS = _Obj(other=COUNT)


def _categories_not_phase(memory: dict, path: tuple) -> None:
    if "phase" in (memory.get("categories") or []):
        _refuse(path + ("categories",), "names of byte counts in the timeline rows", "'phase'")


def _allocator_summary(alloc: dict, path: tuple) -> None:
    if alloc.get("available") and "summary" not in alloc:
        _refuse(path + ("summary",), "the allocator summary (available is true)", "nothing")


TOTALS = _Obj({
    **{k: COUNT for k in ("params", "matmul_params", "trainable_params", "tokens", "flops_causal",
                          "hardware_flops", "activation_bytes", "activation_bytes_peak",
                          "optimizer_state_bytes", "param_bytes", "trainable_param_bytes", "grad_bytes",
                          "grad_bytes_end", "buffer_bytes", "peak_bytes", "bytes_read", "bytes_written",
                          "copy_bytes", "param_matmul_flops_forward")},
    **{k: COUNTS for k in ("flops", "attention_flops", "elementwise_flops", "view_ops")},
    "peak_phase": OPT_STR, "peak_module": OPT_STR, "tokens_source": OPT_STR,
    "step_seconds": _Null(NONNEG), "step_seconds_untraced": _Null(NONNEG), "mfu": _Null(NONNEG),
})

COMPARISON = _Obj({"quantity": STR, "measured": _Null(REAL), "predicted": _Null(REAL),
                   "ratio": _Null(REAL), "explanation": OPT_STR, "unit": OPT_STR},
                  required=("quantity", "measured", "predicted"))
PREDICTIONS = _Obj({"comparisons": _List(COMPARISON)},
                   other=_Either(_Null(REAL), _Obj(), _List(ANY),
                                 describe="a number, null, an object or a list"))

MODULE = _Obj({
    "name": STR, "type": STR, "depth": _Count(0, MAX_MODULE_DEPTH), "flops_share": NONNEG,
    **{k: COUNT for k in ("params", "flops_forward", "flops_backward", "flops_recompute", "flops_self",
                          "activation_bytes", "copy_bytes", "copies", "calls", "peak_bytes")},
}, required=("name",))
OP = _Obj({"op": STR, "phase": STR, "module": OPT_STR, "kind": STR,
           **{k: COUNT for k in ("count", "flops", "flops_causal", "bytes_read", "bytes_written")}})
UNCOUNTED = _Obj({"op": STR, "count": COUNT, "phases": _List(STR), "modules": _List(OPT_STR)},
                 required=("op", "count"))
COPY = _Obj({"op": STR, "module": OPT_STR, "phase": STR, "location": OPT_STR, "reason": STR,
             "count": COUNT, "bytes": COUNT})
FINDING = _Obj({"rule": STR, "severity": _Str(("error", "warning", "info")), "message": STR,
                "module": OPT_STR, "location": OPT_STR, "hint": OPT_STR},
               required=("rule", "severity", "message"))

AUDIT = _Obj({"file": STR, "entry": STR, "device": STR, "steps": COUNT, "seq_len": OPT_COUNT,
              "spec_line": _Null(_Count(1, 2**31 - 1))})
META = _Obj({"model": OPT_STR, "device": OPT_STR, "dtype": OPT_STR, "torch": OPT_STR,
             "attention_kernels": _Null(_List(STR)), "step_index": OPT_COUNT, "ops": COUNT,
             "failed": _Bool(), "phases": _List(STR), "seq_len": OPT_COUNT, "audit": AUDIT})

TIMELINE_ROW = _Obj({"phase": STR}, other=COUNT)
ALLOCATOR = _Obj({"available": _Bool(), "reason": OPT_STR,
                  "summary": _Obj({k: COUNT for k in ("reserved_bytes", "allocated_bytes",
                                                      "largest_free_bytes")} | {"fragmentation": NONNEG},
                                  required=("reserved_bytes", "allocated_bytes", "largest_free_bytes",
                                            "fragmentation"))},
                 after=_allocator_summary)
MEMORY = _Obj({"timeline": _List(TIMELINE_ROW), "categories": _List(STR), "note": OPT_STR,
               "peak_breakdown": COUNTS, "end_breakdown": COUNTS, "phase_peaks": COUNTS,
               "peak_bytes": COUNT, "peak_op_index": COUNT, "recompute_saved_bytes": COUNT,
               "retained_new": COUNTS, "grads": _Obj(other=OPT_COUNT), "allocator": ALLOCATOR,
               "retained": _List(_Obj()), "module_caches": _List(_Obj()), "output_cache": _Obj()},
              after=_categories_not_phase)
OPTIMIZER = _Obj({"names": _List(STR), "kind": OPT_STR, "precision": OPT_STR, "state": _List(_Obj()),
                  "state_bytes": COUNT, "params": COUNT, "bytes_per_param": _Null(NONNEG),
                  "master_weight_bytes": COUNT, "note": OPT_STR})

RECORD = _Obj({"schema": STR, "conventions": _Obj(), "meta": META, "totals": TOTALS,
               "predictions": PREDICTIONS, "modules": _List(MODULE), "ops": _List(OP),
               "uncounted_ops": _List(UNCOUNTED), "copies": _List(COPY), "memory": MEMORY,
               "optimizer": OPTIMIZER, "findings": _List(FINDING), "warnings": _List(STR)})


def check_record(data, schema: str, *, values: bool = True) -> None:
    """Raise :class:`RecordError` unless ``data`` is a record of ``schema`` that renders.

    ``values=False`` skips the walk over every value, for data :func:`parse_record` returned."""
    if not isinstance(data, dict):
        raise RecordError(f"expected a JSON object with schema {schema!r}, got {arrived(data)}")
    if data.get("schema") != schema:
        raise RecordError(f"schema: expected {schema!r}, got {arrived(data.get('schema'))}; "
                          f"is this a torchledger record?")
    if values:
        _check_values(data)
    RECORD.check(data, ())
