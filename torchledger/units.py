"""Parsing and formatting of the numbers users type and read.

Counts accept plain numbers (``7000000000``, ``7e9``, ``7,000``) and SI suffixes
(``K``, ``M``, ``B``/``G``, ``T``, ``P``: powers of 1000). Byte sizes accept ``80GB``
(decimal, 80e9) and ``80GiB`` (binary, 80 * 2**30); a bare number is bytes.
FLOP rates accept ``989.5T``, ``989.5e12``, ``989.5TFLOPS``.

Everything here is pure Python: the ``estimate`` commands never import torch.
"""
from __future__ import annotations

import math
import re

__all__ = [
    "parse_count", "parse_int", "parse_bytes", "parse_flops", "parse_bandwidth",
    "fmt_count", "fmt_bytes", "fmt_flops", "fmt_int", "fmt_mfu", "fmt_ms", "printable", "GB", "GiB",
]

GB = 10**9
GiB = 2**30

_SI = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BIN = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_NUM = r"(-?[0-9][0-9_,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?|-?\.[0-9]+(?:[eE][+-]?[0-9]+)?)"


def _split(text: str, what: str, tail: str) -> tuple[float, str]:
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"\s*([A-Za-z/]*)", s)
    if not m:
        raise ValueError(f"expected {what} such as {tail}, got {text!r}")
    num = float(m.group(1).replace(",", "").replace("_", ""))
    if not math.isfinite(num):
        bare = re.sub(r"^an? ", "", what)          # "a number" -> "a finite number"
        raise ValueError(f"expected a finite {bare}, got {text!r}")
    return num, m.group(2).upper()


def parse_count(text, *, what: str = "a number") -> float:
    """``'7B'`` -> 7e9, ``'15T'`` -> 1.5e13, ``'124439808'`` -> 124439808.0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    num, suffix = _split(text, what, "7e9, 7B or 15T")
    if suffix not in _SI:
        raise ValueError(f"expected {what} such as 7e9, 7B or 15T, got {text!r} "
                         f"(unknown suffix {suffix!r}; use K, M, B, T or P)")
    return num * _SI[suffix]


def parse_int(text, *, what: str = "a whole number") -> int:
    """Like :func:`parse_count` but the result must be a whole number."""
    value = parse_count(text, what=what)
    if value != int(value):
        raise ValueError(f"expected {what}, got {text!r} (not a whole number)")
    return int(value)


def parse_bytes(text, *, what: str = "a size") -> float:
    """``'80GB'`` -> 8e10, ``'80GiB'`` -> 85899345920, ``'1024'`` -> 1024."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    num, suffix = _split(text, what, "80GB or 80GiB")
    if suffix.endswith("B"):
        suffix = suffix[:-1]
    if suffix in _BIN:
        return num * _BIN[suffix]
    if suffix in _SI and suffix != "B":
        return num * _SI[suffix]
    raise ValueError(f"expected {what} such as 80GB or 80GiB, got {text!r}")


def parse_bandwidth(text, *, what: str = "a bandwidth") -> float:
    """Bytes per second: ``'450GB/s'`` -> 4.5e11; ``'400Gb/s'``, ``'400Gbps'`` or
    ``'400Gbit/s'`` (bits, as network links are sold) -> 5e10; a bare number or ``'450G'`` is
    bytes/s. The case of ``b``/``B`` is read as written (``b`` bits, ``B`` bytes); the
    prefixes are decimal (``G`` = 1e9) or binary (``Gi``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return parse_bytes(text, what=what)
    s = str(text).strip()
    m = re.fullmatch(_NUM + r"\s*([KkMmGgTtPp]i?)?(bits?|bytes?|[bB])?(/[sS]|[pP][sS])?", s)
    if not m:
        raise ValueError(f"expected {what} such as 450GB/s (bytes) or 400Gb/s (bits), got {text!r}")
    num, _ = _split(m.group(1), what, "450GB/s")
    prefix, unit = (m.group(2) or "").upper(), m.group(3) or "B"
    scale = _BIN[prefix] if prefix in _BIN else _SI[prefix]
    bits = unit.startswith("bit") or unit == "b"
    return num * scale / (8 if bits else 1)


def parse_flops(text, *, what: str = "a FLOP/s rate") -> float:
    """``'989.5T'``, ``'989.5TFLOPS'``, ``'9.895e14'`` -> 9.895e14."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    num, suffix = _split(text, what, "989.5T or 9.895e14")
    for unit in ("FLOP/S", "FLOPS", "FLOP", "F"):
        if suffix.endswith(unit):
            suffix = suffix[: -len(unit)]
            break
    if suffix not in _SI or suffix == "B":
        raise ValueError(f"expected {what} such as 989.5T or 9.895e14, got {text!r}")
    return num * _SI[suffix]


def fmt_int(n) -> str:
    """``6738415616`` -> ``'6,738,415,616'``."""
    return f"{int(n):,}"


def fmt_count(n: float, digits: int = 3) -> str:
    """``6738415616`` -> ``'6.74B'``; small numbers are printed as they are."""
    n = float(n)
    for suffix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}g}{suffix}"
    return f"{n:.{digits}g}"


def fmt_bytes(n: float, binary: bool | None = None) -> str:
    """Bytes with both readings where they differ: ``'112.0 GB (104.3 GiB)'``.

    ``binary=True`` prints only the binary unit, ``False`` only the decimal one.
    """
    n = float(n)
    dec = _scaled(n, 1000, ["B", "KB", "MB", "GB", "TB", "PB"])
    bi = _scaled(n, 1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
    if binary is True:
        return bi
    if binary is False or abs(n) < 1000:
        return dec
    return f"{dec} ({bi})"


def _scaled(n: float, base: int, units: list[str]) -> str:
    i = 0
    while abs(n) >= base and i < len(units) - 1:
        n /= base
        i += 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.1f} {units[i]}"


def fmt_flops(n: float) -> str:
    """``6.3e24`` -> ``'6.3e+24 FLOPs'`` (scientific: FLOP counts span 20 orders)."""
    return f"{float(n):.3g} FLOPs"


def fmt_mfu(value) -> str:
    """An MFU for a human: three significant digits (0.42, 0.087, 0.000123)."""
    return f"{value:.3g}"


def fmt_ms(s: float) -> str:
    """Seconds in milliseconds (``12.3 ms``), or in seconds from 1 s up (``1.23 s``)."""
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def printable(text) -> str:
    """``text`` for one line of a table or message: control and other unprintable characters
    escaped (a newline in a file name reads ``\\n``, not a second line)."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)
