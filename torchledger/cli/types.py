"""click parameter types for the numbers users type (``7B``, ``80GB``, ``989.5T``)."""
from __future__ import annotations

import math
import os

import click

from .. import units
from ..errors import InputError, StdoutError

__all__ = ["InputError", "StdoutError", "echo_out", "check_output", "check_folder", "gpu_part", "PlainNumber",
           "SECONDS", "MAX_TIMEOUT_S", "COUNT",
           "POS_INT", "BYTES", "FLOPS", "POS_FLOAT", "FRACTION", "BANDWIDTH", "MICRO_BATCHES", "GLOBAL_BATCH",
           "MAX_MICRO_BATCHES"]


def echo_out(text: str, nl: bool = True) -> None:
    """Write a command's data to stdout, or raise :class:`StdoutError`: a stdout closed before
    the command started (``>&-``: Python has no ``sys.stdout``, and ``click.echo`` would write
    nothing and report success), closed since, full (``>/dev/full``) or a pipe whose reader
    went away (``| head -c0``)."""
    import errno
    import sys
    if sys.stdout is None:
        raise StdoutError(errno.EBADF, "stdout is closed")
    try:
        click.echo(text, nl=nl)
    except ValueError as e:                     # "I/O operation on closed file"
        raise StdoutError(errno.EBADF, f"stdout is closed ({e})") from None
    except OSError as e:
        raise StdoutError(e.errno or errno.EIO, e.strerror or str(e)) from None


def check_output(output) -> None:
    """``--output newdir/`` names a directory: a usage error before any work, not a file
    named ``newdir``."""
    if output:
        from ..render.output import check_output_path  # lazy: CLI startup
        try:
            check_output_path(output)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--output") from None


def check_folder(flag: str, path) -> None:
    """``--output a/b/out.json``: folders that do not exist are made when the file is written
    (as ``record.save()`` and ``Ledger.save()`` make them); one that cannot be made (a file in
    the way, a folder not writable) is one line before the run, not after minutes of it."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == folder:
        return                               # written as before (write_atomic says the rest)
    if not os.path.isdir(existing):
        raise InputError(f"{flag} {path}: cannot create the folder {os.path.dirname(path) or folder}: "
                         f"{existing} is a file, not a folder; write elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot create the folder {os.path.dirname(path) or folder}: "
                         f"{existing} is not writable; write elsewhere")


#: ``--sequence-parallel``'s choices and what they mean to a ``Layout`` (None: not given).
ON_OFF = ("on", "off")


def on_off(value) -> "bool | None":
    """``"on"`` -> True, ``"off"`` -> False, None -> None (the option not given)."""
    return {"on": True, "off": False}.get(value)


def gpu_part(name, flag: str = "--gpu", ctx=None, param=None):
    """The ``GPUSpec`` of ``name``. A bad ``TORCHLEDGER_HARDWARE`` file is bad input (one line
    naming the file, the part and the field), not a bad ``--gpu``; an unknown or empty name
    is a bad ``flag``."""
    from ..formulas.hardware import HardwareFileError, get_gpu  # lazy: CLI startup
    if not str(name).strip():
        raise click.BadParameter("expected a GPU name such as H100, got an empty string", ctx, param,
                                 param_hint=None if param is not None else flag)
    try:
        return get_gpu(name)
    except HardwareFileError as e:
        raise InputError(str(e)) from None
    except (KeyError, ValueError) as e:
        raise click.BadParameter(str(e).strip("'\""), ctx, param,
                                 param_hint=None if param is not None else flag) from None


class _Number(click.ParamType):
    def __init__(self, name, parse, *, integer=False, positive=True, upper=None, example="7B", why=""):
        self.name, self._parse, self._integer = name, parse, integer
        self._positive, self._upper, self._example, self._why = positive, upper, example, why

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            num = float(value)
        else:
            try:
                num = self._parse(value)
            except ValueError as e:
                self.fail(str(e), param, ctx)
        if self._positive and num <= 0:
            self.fail(f"expected a number > 0 such as {self._example}, got {value!r}", param, ctx)
        if self._upper is not None and num > self._upper:
            self.fail(f"expected a number <= {self._upper:g}{self._why}, got {value!r}", param, ctx)
        if self._integer:
            whole = round(num)
            if abs(num - whole) > max(1e-6, 1e-12 * abs(num)):   # 8.03B is 8029999999.999999
                hint = (f" (a count: did you mean {value}B?)" if self.name == "count"
                        and isinstance(value, str) and value[-1:].isdigit() else "")
                self.fail(f"expected a whole number such as {self._example}, got {value!r}{hint}",
                          param, ctx)
            return int(whole)
        return num


#: A positive whole count of parameters or tokens (``7B``, ``7.5B``, ``15T``, ``1.3e9``): a
#: fraction left after the suffix (``7.5``) is refused, as a suffix is likely missing.
COUNT = _Number("count", units.parse_count, integer=True, example="7B")
#: A positive whole count (layers, heads, GPUs, parameters when exact).
POS_INT = _Number("integer", units.parse_count, integer=True, example="32")
#: A positive byte size (``80GB``, ``80GiB``).
BYTES = _Number("size", units.parse_bytes, example="80GB")
#: A positive FLOP/s rate (``989.5T``).
FLOPS = _Number("flop/s", units.parse_flops, example="989.5T")
#: A positive real number.
POS_FLOAT = _Number("number", units.parse_count, example="0.5")
#: A fraction in (0, 1] (MFU).
#: A bandwidth in bytes/s: ``450GB/s``, ``450GB``, ``4.5e11`` (GB = 1e9, vendor units);
#: ``400Gb/s`` / ``400Gbps`` are bits (/8), as network links are sold.
BANDWIDTH = _Number("bandwidth", units.parse_bandwidth, example="450GB/s")
FRACTION = _Number("fraction", units.parse_count, upper=1.0, example="0.5")
#: Micro-batches per step: each multiplies the step's FLOPs and bytes, which records hold in
#: int64; a million is far past any real schedule (thousands), 1e12 is a typo.
MAX_MICRO_BATCHES = 10**6
MICRO_BATCHES = _Number("integer", units.parse_count, integer=True, upper=MAX_MICRO_BATCHES, example="8",
                        why=" (each micro-batch multiplies the step's FLOPs, which records count in int64)")
#: Sequences per step over all data-parallel ranks (Llama 3 405B: 2,048 of 8,192 tokens).
GLOBAL_BATCH = _Number("integer", units.parse_count, integer=True, upper=10**9, example="2048",
                       why=" (sequences per step; the step's FLOPs are counted in int64)")


class PlainNumber(click.ParamType):
    """A number typed in ASCII (``int()`` and ``float()`` also read full-width ``８`` and
    Arabic-Indic ``٨`` digits, which no one types for a count on purpose), finite, within
    ``[low, high]`` (either may be None: no bound)."""

    def __init__(self, low=None, high=None, *, integer=True, example="8", note=""):
        self.name = "integer" if integer else "number"
        self._low, self._high, self._integer = low, high, integer
        self._example, self._note = example, note

    def _expected(self) -> str:
        kind = "a whole number" if self._integer else "a number"
        bounds = [f">= {self._low:g}" if self._low is not None else "",
                  f"<= {self._high:g}" if self._high is not None else ""]
        within = " and ".join(b for b in bounds if b)
        return f"{kind}{' ' + within if within else ''} in ASCII digits, such as {self._example}{self._note}"

    def convert(self, value, param, ctx):
        if isinstance(value, bool):
            self.fail(f"expected {self._expected()}, got {value!r}", param, ctx)
        if isinstance(value, (int, float)):
            num = value
        else:
            text = str(value).strip()
            try:
                if not text.isascii():
                    raise ValueError
                num = int(text) if self._integer else float(text)
            except ValueError:
                self.fail(f"expected {self._expected()}, got {_shown(value)}", param, ctx)
        if (not math.isfinite(num) or (self._low is not None and num < self._low)
                or (self._high is not None and num > self._high)):
            self.fail(f"expected {self._expected()}, got {_shown(value)}", param, ctx)
        return num


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(str(value)):,} characters)"


#: The longest ``audit --timeout``: past it (about 11 days) a limit is no limit (0 says so);
#: ``inf``, ``nan`` and 1e10 (beyond what ``select`` can wait) are refused, not tracebacks.
MAX_TIMEOUT_S = 1e6
#: ``audit --timeout``: seconds, 0 for no limit.
SECONDS = PlainNumber(0, MAX_TIMEOUT_S, integer=False, example="1800", note=" (0: no limit)")
