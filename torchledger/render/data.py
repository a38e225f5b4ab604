"""Machine-readable renderers: the record as one JSON object, the modules as CSV rows.

Both stay parseable for an empty record: JSON is the empty record's object (all totals
zero), CSV is the header row alone.
"""
from __future__ import annotations

import json

from .common import as_findings, module_rows

__all__ = ["render_json", "render_csv", "CSV_COLUMNS", "csv_cell"]

#: A spreadsheet reads a cell starting with one of these as a formula (OWASP, CSV injection).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

CSV_COLUMNS = ["name", "type", "depth", "params", "flops_forward", "flops_backward", "flops_share",
               "activation_bytes", "peak_bytes", "copies", "copy_bytes", "calls"]


def render_json(record, findings=None, *, indent: int = 2, **_options) -> str:
    """``record.to_dict()`` with ``findings`` in place of the record's own, as one JSON object."""
    d = record.to_dict()
    d["findings"] = [f.to_dict() for f in as_findings(record, findings)]
    return json.dumps(d, indent=indent, default=_jsonable)


def render_csv(record, findings=None, *, depth=None, **_options) -> str:
    """One row per module (all of them, or down to ``depth``), columns :data:`CSV_COLUMNS`.

    The root module's name is the empty string, as in ``named_modules()``; ops that ran
    outside every module are the row ``(no module)``. Findings are not part of the CSV.
    Text cells that a spreadsheet would run as a formula are prefixed with ``'`` (:func:`csv_cell`).
    """
    import pandas as pd

    rows = [{k: csv_cell(v) for k, v in row.items()} for row in module_rows(record, depth)]
    columns = CSV_COLUMNS + (["predicted_seconds"] if any("predicted_seconds" in r for r in rows) else [])
    df = pd.DataFrame(rows, columns=columns)           # audit --gpu adds predicted_seconds
    return df.to_csv(index=False, lineterminator="\n").rstrip("\n")


def csv_cell(value):
    """``value`` safe to open in a spreadsheet: a string that starts like a formula gets a
    leading ``'`` (OWASP's advice: it then shows as text); numbers, negative ones included,
    stay numbers. A carriage return in text is written as the two characters ``\\r``."""
    if not isinstance(value, str):
        return value
    value = value.replace("\r", "\\r")       # NB: lines end in \n, so the writer leaves a CR unquoted
    return "'" + value if value.startswith(FORMULA_START) else value


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)
