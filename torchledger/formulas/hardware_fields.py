"""The fields of one part's row (``register_gpu``, a ``TORCHLEDGER_HARDWARE`` file), checked.

Every field is checked for its type, its unit and its range before it reaches the closed
forms: a NaN memory would make every step "fit", a negative bandwidth writes records
``report`` refuses, ``sm_count 1e30`` predicts a step of 1e24 s, a misspelt efficiency key
would be dropped. A bad field is a :class:`HardwareFieldError` naming the part and the field:

    >>> check_row("H100", {"memory": -1})
    Traceback (most recent call last):
    ...
    torchledger.formulas.hardware_fields.HardwareFieldError: part 'H100': memory: expected a size in bytes > 0 and at most 1e+15 such as "80GB", got -1

The ranges are generous (a thousand times today's largest parts) but finite: they refuse
typos and units mixed up, not parts yet to come.
"""
from __future__ import annotations

import difflib
import math

from .. import units

__all__ = ["HardwareFieldError", "check_row", "normalize_dtype", "DTYPES", "ROW_FIELDS", "EFFICIENCY_FIELDS"]

#: Bytes, bytes/s and FLOP/s above these are typos (today's largest parts: 192 GB, 8 TB/s,
#: 4.5 PFLOP/s).
MAX_BYTES = 1e15
MAX_RATE = 1e15
MAX_FLOPS = 1e18
#: Streaming multiprocessors, GPUs and NICs per node.
MAX_SMS = 100_000
MAX_PER_NODE = 4096
#: Dtypes that have a peak FLOP/s column.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
ATTENTION_KERNELS = ("flash", "cudnn", "efficient")


class HardwareFieldError(ValueError):
    """One field of a part's row that cannot be used: the message is one line."""


def _fail(where: str, expected: str, value) -> None:
    raise HardwareFieldError(f"{where}: expected {expected}, got {_arrived(value)}")


def _arrived(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("-" if value < 0 else "") + "Infinity"
    if isinstance(value, (int, float)):
        return f"{value:g}" if abs(value) < 1e300 else "a huge number"
    if isinstance(value, str):
        return "a string " + ascii(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _real(value, where, low, high, *, low_open=True, example="0.5", what="a number") -> float:
    """A finite number in (low, high] (or [low, high] with ``low_open=False``)."""
    above = f"> {low:g}" if low_open else f">= {low:g}"
    expected = f"{what} {above} and at most {high:g} such as {example}"
    if not _is_number(value):
        _fail(where, expected, value)
    x = float(value)
    if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
        _fail(where, expected, value)
    return x


def _whole(value, where, low, high, example) -> int:
    expected = f"a whole number from {low} to {high} such as {example}"
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or not low <= value <= high:
        _fail(where, expected, value)
    return int(value)


def _quantity(value, where, parse, high, example, unit) -> float:
    """A size or a rate: a number (bytes, bytes/s, FLOP/s) or a string with its unit."""
    expected = f"a {unit} > 0 and at most {high:g} such as \"{example}\""
    if isinstance(value, str):
        try:
            value = parse(value)
        except ValueError:
            _fail(where, expected, value)
    return _real(value, where, 0.0, high, what=f"a {unit}", example=f'"{example}"')


def _size(value, where):
    return _quantity(value, where, units.parse_bytes, MAX_BYTES, "80GB", "size in bytes")


def _rate(value, where):
    return _quantity(value, where, units.parse_bandwidth, MAX_RATE, "3.35TB/s", "bandwidth in bytes/s")


def _peaks(value, where) -> dict:
    if not isinstance(value, dict):
        _fail(where, 'an object of dtype -> FLOP/s such as {"bf16": "989.5T"}', value)
    out = {}
    for dtype, peak in value.items():
        try:
            key = normalize_dtype(dtype)
        except ValueError:
            key = _known(dtype, DTYPES, where)          # raises, naming the near one
        out[key] = None if peak is None else _quantity(peak, f"{where}.{key}", units.parse_flops,
                                                       MAX_FLOPS, "989.5T", "FLOP/s rate")
    return out


_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "half": "fp16", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8"}


def normalize_dtype(dtype: str) -> str:
    """``'bfloat16'`` -> ``'bf16'``; unknown names raise ``ValueError`` listing the known ones."""
    key = str(dtype).lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return key


def _aliases(value, where) -> tuple:
    expected = 'a list of names such as ["h100-80gb"]'
    if not isinstance(value, (list, tuple)):
        _fail(where, expected, value)
    for i, alias in enumerate(value):
        if not isinstance(alias, str) or not alias.strip() or len(alias) > 200:
            _fail(f"{where}[{i}]", "a name (a non-empty string of at most 200 characters)", alias)
    return tuple(value)


def _sources(value, where) -> dict:
    if not isinstance(value, dict):
        _fail(where, 'an object of field -> text such as {"peaks": "vendor datasheet"}', value)
    for key, text in value.items():
        if not isinstance(text, str):
            _fail(f"{where}.{key}", "a string", text)
    return dict(value)


# -- efficiency ---------------------------------------------------------------------------------
def _fraction(value, where):
    return _real(value, where, 0.0, 1.0)


def _tiles(value, where):
    expected = "a non-empty list of [rows, columns] tiles such as [[128, 128], [64, 64]]"
    if not isinstance(value, list) or not value:
        _fail(where, expected, value)
    for i, tile in enumerate(value):
        if not isinstance(tile, list) or len(tile) != 2:
            _fail(f"{where}[{i}]", "[rows, columns], two whole numbers such as [128, 128]", tile)
        for j, side in enumerate(tile):
            _whole(side, f"{where}[{i}][{j}]", 1, 65536, 128)
    return [list(map(int, tile)) for tile in value]


def _attention(value, where):
    if not isinstance(value, dict):
        _fail(where, 'an object of kernel -> [forward, backward] fractions such as {"flash": [0.65, 0.55]}',
              value)
    out = {}
    for kernel, pair in value.items():
        _known(kernel, ATTENTION_KERNELS, where)
        if not isinstance(pair, list) or len(pair) != 2:
            _fail(f"{where}.{kernel}", "[forward, backward] fractions such as [0.65, 0.55]", pair)
        out[kernel] = [_fraction(f, f"{where}.{kernel}[{i}]") for i, f in enumerate(pair)]
    return out


def _kernel(value, where):
    if value not in ATTENTION_KERNELS:
        _fail(where, f"one of {', '.join(ATTENTION_KERNELS)}", value)
    return value


def _fp32_kernel(value, where):
    if value is not None and value not in ATTENTION_KERNELS + ("math",):
        _fail(where, f"null (SDPA's CUDA rule) or one of {', '.join(ATTENTION_KERNELS + ('math',))}", value)
    return value


def _flag(value, where):
    if not isinstance(value, bool):
        _fail(where, "true or false", value)
    return value


#: Every parameter of ``steptime.DEFAULT_EFFICIENCY`` -> its check.
EFFICIENCY_FIELDS = {
    "matmul_peak_fraction": _fraction,
    "memory_fraction": _fraction,
    "nvlink_fraction": _fraction,
    "network_fraction": _fraction,
    "matmul_tiles": _tiles,
    "matmul_k_tile": lambda v, w: _whole(v, w, 1, 65536, 64),
    "matmul_min_intensity": lambda v, w: _real(v, w, 0.0, 1e6, example="85"),
    "matmul_k_overhead": lambda v, w: _real(v, w, 0.0, 1e4, low_open=False, example="2"),
    "launch_s": lambda v, w: _real(v, w, 0.0, 1.0, low_open=False, what="seconds", example="5e-6"),
    "attention_kernel": _kernel,
    "attention_kernel_fp32": _fp32_kernel,
    "attention": _attention,
    "attention_seq_half": lambda v, w: _real(v, w, 0.0, 1e9, low_open=False, example="256"),
    "attention_causal_fraction": _fraction,
    "allow_tf32": _flag,
    "sustained_fraction": _fraction,
    "overlap_slowdown": lambda v, w: _real(v, w, 0.0, 1.0, low_open=False, example="0.1"),
    "nvls_fraction": lambda v, w: _real(v, w, 0.0, 4.0, low_open=False, example="1.067"),
}


def _efficiency(value, where) -> dict:
    if not isinstance(value, dict):
        _fail(where, 'an object such as {"matmul_peak_fraction": 0.75}', value)
    return {key: EFFICIENCY_FIELDS[_known(key, EFFICIENCY_FIELDS, where)](item, f"{where}.{key}")
            for key, item in value.items()}


def _known(key, fields, where) -> str:
    if key in fields:
        return key
    near = difflib.get_close_matches(str(key), list(fields), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    shown = ascii(key if len(str(key)) <= 40 else str(key)[:37] + "...")
    raise HardwareFieldError(f"{where}: unknown key {shown}{hint}; expected one of "
                             f"{', '.join(fields)}")


#: Every field of a part's row -> (the GPUSpec attribute, its check).
ROW_FIELDS = {
    "memory": ("memory_bytes", _size),
    "bandwidth": ("bandwidth_bytes_per_s", _rate),
    "peak_flops": ("peak_flops", _peaks),
    "aliases": ("aliases", _aliases),
    "sm_count": ("sm_count", lambda v, w: _whole(v, w, 1, MAX_SMS, 132)),
    "nvlink": ("nvlink_bytes_per_s", _rate),
    "nic": ("nic_bytes_per_s", _rate),
    "nics_per_node": ("nics_per_node", lambda v, w: _whole(v, w, 1, MAX_PER_NODE, 8)),
    "gpus_per_node": ("gpus_per_node", lambda v, w: _whole(v, w, 1, MAX_PER_NODE, 8)),
    "efficiency": ("efficiency", _efficiency),
    "sources": ("sources", _sources),
}


def check_row(name, row) -> dict:
    """``{GPUSpec attribute: value}`` for the fields of ``row`` (a part's JSON object; a field
    that is ``None`` is left out), each checked; ``HardwareFieldError`` on the first bad one."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise HardwareFieldError(f"part {_arrived(name)}: expected a part name (a non-empty string of "
                                 f"at most 200 characters)")
    where = f"part {name!r}"
    if not isinstance(row, dict):
        _fail(where, 'an object of fields such as {"memory": "80GB", "bandwidth": "3.35TB/s", '
                     '"peak_flops": {"bf16": "989.5T"}}', row)
    out = {}
    for key, value in row.items():
        attr, check = ROW_FIELDS[_known(key, ROW_FIELDS, where)]
        if value is not None:
            out[attr] = check(value, f"{where}: {key}")
    return out
