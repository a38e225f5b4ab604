"""Where rendered text goes: the format a file name asks for, and a write that is all or nothing."""
from __future__ import annotations

import os

from ..files import check_output_path, launcher_rank, make_folders, rank_path, write_atomic  # noqa: F401

__all__ = ["EXTENSIONS", "format_from_path", "check_output_path", "write_atomic", "rank_path", "launcher_rank",
           "make_folders"]

#: File name endings and the format each asks for; longest endings are tried first.
EXTENSIONS = {
    ".json": "json", ".csv": "csv", ".md": "markdown", ".markdown": "markdown", ".sarif": "sarif",
    ".sarif.json": "sarif", ".html": "html", ".htm": "html", ".txt": "table",
    ".trace.json": "trace", ".perfetto.json": "trace",
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
