"""Renderers: ``render_x(record, findings, **options) -> str``; the caller prints or writes.

    >>> from torchledger.render import render, format_from_path, write_atomic
    >>> text = render(t.record, t.findings(), "markdown", depth=2)
    >>> write_atomic("step.html", render(t.record, t.findings(), format_from_path("step.html")))

Formats: ``table`` (terminal text), ``json`` (the record with findings, one object), ``csv``
(one row per module), ``markdown`` (pull-request comments), ``sarif`` (SARIF 2.1.0 for
code scanning), ``html`` (one self-contained page with inline SVG charts) and ``trace``
(Trace Event JSON for ui.perfetto.dev and chrome://tracing; files ending ``.trace.json``).
``findings=None`` renders the record's own ``findings``. Every renderer accepts an empty
``StepRecord()``: the human formats say so in a sentence, the machine formats stay parseable.
Returned text has no trailing newline (``print`` adds one; add ``"\\n"`` when writing a file
that should match stdout).
"""
from __future__ import annotations

from .data import render_csv, render_json
from .html_report import render_html
from .markdown import render_markdown
from .output import EXTENSIONS, format_from_path, write_atomic
from .sarif import findings_to_sarif, render_sarif
from .table import render_table
from .trace_events import render_trace

__all__ = ["RENDERERS", "render", "format_from_path", "write_atomic", "findings_to_sarif", "EXTENSIONS",
           "render_table", "render_json", "render_csv", "render_markdown", "render_sarif", "render_html",
           "render_trace"]

RENDERERS = {
    "table": render_table,
    "json": render_json,
    "csv": render_csv,
    "markdown": render_markdown,
    "sarif": render_sarif,
    "html": render_html,
    "trace": render_trace,
}


def render(record, findings=None, fmt: str = "table", **options) -> str:
    """Render ``record`` and ``findings`` in format ``fmt`` (a key of :data:`RENDERERS`).

    Options a format does not use (``depth`` for json, say) are ignored.
    """
    try:
        renderer = RENDERERS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown report format {fmt!r}; expected one of {', '.join(RENDERERS)}") from None
    return renderer(record, findings, **options)
