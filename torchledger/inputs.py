"""Reading the files users hand the CLI (records, baselines, snapshots, lint sources).

One rule for every input file: it must be a regular file (a FIFO would hang the reader, a
device such as ``/dev/zero`` never ends), and it is read up to a size limit, so a data file
can make the tool refuse but never hang it or exhaust memory. Paths named *inside* a data
file are never opened.

    data = read_input("a.json", what="record", max_bytes=RECORD_MAX_BYTES)
"""
from __future__ import annotations

import os
import stat

__all__ = ["InputFileError", "read_input", "RECORD_MAX_BYTES", "SNAPSHOT_MAX_BYTES",
           "SOURCE_MAX_BYTES"]

#: Records: a 7B audit's record is about 200 KB; a thousand times that is no record.
RECORD_MAX_BYTES = 256 * 2**20
#: CUDA allocator snapshots of long runs reach hundreds of MB.
SNAPSHOT_MAX_BYTES = 4 * 2**30
#: Python sources for lint: the largest hand-written modules are a few MB.
SOURCE_MAX_BYTES = 32 * 2**20


class InputFileError(ValueError):
    """An input file that cannot be read as asked: the message is one line for the user."""


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def read_input(path, *, what: str = "input", max_bytes: int = RECORD_MAX_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``.

    Raises ``InputFileError`` (one line: the path, what arrived, what was expected) for a
    missing file, a directory, a FIFO, socket or device, a file over the limit, or an OS
    error. The file is opened non-blocking, so a FIFO that appears between the check and the
    open does not hang, and it is checked again through the open descriptor.
    """
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise InputFileError(f"{name}: no such file; expected a {what} file") from None
    except OSError as e:
        raise InputFileError(f"{name}: cannot read ({e.strerror or e})") from None
    _check(name, st, what, max_bytes)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)
    except OSError as e:
        raise InputFileError(f"{name}: cannot read ({e.strerror or e})") from None
    try:
        _check(name, os.fstat(fd), what, max_bytes)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:       # grew while being read
                raise InputFileError(f"{name}: larger than {_size(max_bytes)}; expected a "
                                     f"{what} file of at most that size")
        return b"".join(chunks)
    except OSError as e:
        raise InputFileError(f"{name}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _check(name: str, st: os.stat_result, what: str, max_bytes: int) -> None:
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise InputFileError(f"{name}: is a directory; expected a {what} file")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise InputFileError(f"{name}: is {kind}; expected a regular {what} file "
                             f"(save it to a file first)")
    if st.st_size > max_bytes:
        raise InputFileError(f"{name}: {_size(st.st_size)} is larger than {_size(max_bytes)}; "
                             f"expected a {what} file of at most that size")
