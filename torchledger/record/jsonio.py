"""Strict, bounded JSON for records: the text of a saved record into plain data, or one line.

Nesting is checked before ``json`` recurses (1,100 brackets raised RecursionError); NaN,
Infinity and numbers past int64 or float range (a 4,000-digit int raised OverflowError in the
renderers) and lone surrogates (UnicodeEncodeError on output) are refused with their path:

    parse_record('{"totals": {"params": NaN}}')   # raises RecordError, one line:
    totals.params: expected a finite number (JSON has no NaN or Infinity), got NaN

:mod:`torchledger.record.schema` then checks the shape.
"""
from __future__ import annotations

import itertools
import json
import math
import re

__all__ = ["RecordError", "parse_record", "check_values", "past_int64", "arrived", "fail", "refuse", "MAX_DEPTH",
           "MAX_STRING", "MAX_INT"]

#: Deepest nesting of objects and lists; ``to_dict()`` writes 5 (meta.config may add a few).
MAX_DEPTH = 32
#: Longest string, in characters: messages and tracebacks in warnings stay far below.
MAX_STRING = 1 << 20
#: Counts, FLOPs and bytes: the tracer sums them in int64.
MAX_INT = 2**63 - 1


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
        check_values(data)
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
        refuse(path, f"{noun} of at most {MAX_STRING:,} characters", f"{len(s):,} characters")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            refuse(path, f"{noun} that UTF-8 can encode", f"a lone surrogate {ascii(s[e.start])}")


def check_values(data) -> None:
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
                refuse(path, "a whole number within int64 (at most 2**63-1)",
                        repr(_Bad(str(value))) if abs(value) < 10**400 else "a huge number")
        elif isinstance(value, float):
            if not math.isfinite(value):
                fail(path, "a finite number", value)
        elif isinstance(value, _Bad):
            fail(path, value.expected, value)
        elif isinstance(value, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                refuse(path, f"at most {MAX_DEPTH} levels of nesting", "deeper nesting")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        refuse(path, "string keys", f"a key {arrived(key)}")
                    _check_string(key, path, "a key")
                    stack.append((item, path + (key,), depth + 1))
            else:
                stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))
        else:
            refuse(path, "a JSON value", type(value).__name__)


def past_int64(data):
    """``(path, value)`` of the first whole number in ``data`` outside int64 (a record about
    to be written: ``report`` would refuse it), else None."""
    import collections
    queue = collections.deque([(data, ())])          # breadth first: totals before their parts
    while queue:
        value, path = queue.popleft()
        if isinstance(value, dict):
            queue.extend((v, path + (k,)) for k, v in value.items() if isinstance(k, str))
        elif isinstance(value, (list, tuple)):
            queue.extend((v, path + (i,)) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT - 1 <= value <= MAX_INT:
            return _where(path), value
    return None


def fail(path: tuple, expected: str, value) -> None:
    """Refuse ``value`` at ``path``."""
    refuse(path, expected, arrived(value))


def refuse(path: tuple, expected: str, got: str) -> None:
    err = RecordError(f"{_where(path)}: expected {expected}, got {got}")
    err.path = path
    raise err
