"""Where rendered text goes: the format a file name asks for, and a write that is all or nothing."""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, Union

__all__ = ["EXTENSIONS", "format_from_path", "write_atomic"]

#: File name endings and the format each asks for; longest endings are tried first.
EXTENSIONS = {
    ".json": "json", ".csv": "csv", ".md": "markdown", ".markdown": "markdown", ".sarif": "sarif",
    ".sarif.json": "sarif", ".html": "html", ".htm": "html", ".txt": "table",
}


def format_from_path(path) -> str:
    """The format a file name asks for: ``report.md`` -> ``'markdown'``, ``x.sarif.json`` -> ``'sarif'``.

    Raises ValueError, listing the known endings, for any other name.
    """
    name = os.path.basename(os.fspath(path)).lower()
    for ending in sorted(EXTENSIONS, key=len, reverse=True):
        if name.endswith(ending) and len(name) > len(ending):
            return EXTENSIONS[ending]
    known = ", ".join(f"{e} ({f})" for e, f in EXTENSIONS.items())
    raise ValueError(f"cannot tell the report format from {os.fspath(path)!r}: expected a file ending "
                     f"in one of {known}; or pass --format")


def write_atomic(path, text: Union[str, Iterable[str]]) -> None:
    """Write ``text`` (a string, bytes, or an iterable of string chunks) to ``path`` all at once.

    The text goes to a temporary file in the same directory, is flushed to disk, and then
    replaces ``path`` in one ``os.replace``. If anything fails on the way (a chunk iterator
    raising, a full disk) the temporary file is removed and ``path`` is left as it was.
    The text is written exactly as given (UTF-8, no newline translation).

    Known limitations: the new file gets the old file's permission bits if it existed, else
    the process umask's defaults; ownership and extended attributes are not carried over.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    binary = isinstance(text, (bytes, bytearray))
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as fh:
            for chunk in ([text] if isinstance(text, (str, bytes, bytearray)) else text):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _mode_for(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
