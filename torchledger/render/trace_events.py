"""The traced step as Trace Event JSON text, for ui.perfetto.dev and chrome://tracing.

    >>> from torchledger.render.trace_events import render_trace
    >>> open("step.trace.json", "w").write(render_trace(t.record))     # then open it in Perfetto

The events themselves are the record's own form (:mod:`torchledger.record.trace`, what
``record.to_trace()`` returns); this writes them one event per line, keys sorted.
"""
from __future__ import annotations

import json

from ..record.trace import SYNTHETIC_CLOCK, plain, trace_events

__all__ = ["render_trace", "trace_events", "SYNTHETIC_CLOCK"]


def render_trace(record, findings=None, **_options) -> str:
    """Trace Event JSON text (``{"traceEvents": [...], ...}``) of ``record``; ``findings=None``
    uses the record's own. Options of other formats (``depth``, ``width``) are ignored."""
    d = trace_events(record, findings)
    head = {k: v for k, v in d.items() if k != "traceEvents"}
    lines = [json.dumps(e, sort_keys=True, default=plain) for e in d["traceEvents"]]
    body = json.dumps(head, sort_keys=True, default=plain)[:-1]
    return body + ', "traceEvents": [\n' + ",\n".join(lines) + "\n]}"
