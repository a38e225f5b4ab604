"""Markdown for pull-request comments (GitHub-flavoured tables, no HTML, no emoji).

    >>> text = render_markdown(record, findings, depth=2)

Sections: header (model, device, dtype, attention kernel, conventions), findings, totals,
predicted vs measured, per-layer table, copies, uncounted ops, tracer warnings.
"""
from __future__ import annotations

from ..units import fmt_bytes, fmt_count
from .common import (CONVENTIONS_LINE, EMPTY_SENTENCE, SEVERITY_ORDER, as_findings, comparison_rows, run_notes,
                     is_empty, kernel_line, module_rows, title, totals_rows, with_hint)

__all__ = ["render_markdown", "md_table", "md_escape"]

_MARKERS = {"error": "**[error]**", "warning": "**[warning]**", "info": "[info]"}


def md_escape(text) -> str:
    """Text safe inside a table cell or list item: pipes, backticks, newlines and HTML defused."""
    s = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    s = s.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").replace("_", "\\_")
    return " ".join(s.splitlines())


def md_table(headers, rows, align=None) -> str:
    """A pipe table; ``align`` is one of 'l'/'r' per column (default: left)."""
    align = align or "l" * len(headers)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(record, findings=None, *, depth: int = 2, **_options) -> str:
    findings = sorted(as_findings(record, findings), key=lambda f: SEVERITY_ORDER.get(f.severity, 9))
    out = [f"### {md_escape(title(record))}", ""]
    if is_empty(record):
        out += [EMPTY_SENTENCE, ""]
        out += _findings(findings)
        return "\n".join(out).rstrip("\n")
    out += [md_escape(kernel_line(record)), "", f"Conventions: {md_escape(CONVENTIONS_LINE)}.", ""]
    out += [line for note in run_notes(record) for line in (md_escape(note), "")]
    out += _findings(findings)
    out += ["#### Totals", "", md_table(["quantity", "value"], totals_rows(record), "lr"), ""]
    comparisons = comparison_rows(record)
    if comparisons:
        out += ["#### Predicted vs measured", "",
                md_table(["quantity", "measured", "predicted", "ratio", "explanation"],
                         [[c["quantity"], c["measured"], c["predicted"], c["ratio"], c["explanation"]]
                          for c in comparisons], "lrrrl"), ""]
    out += [f"#### Per layer (depth {depth})", "", _layers(record, depth), ""]
    out += _copies(record)
    if record.uncounted_ops:
        out += ["#### Uncounted ops (no FLOP formula; not in totals)", "",
                md_table(["op", "count", "phases"],
                         [[u["op"], u.get("count", 0), ", ".join(u.get("phases", []))]
                          for u in record.uncounted_ops], "lrl"), ""]
    if record.warnings:
        out += ["#### Tracer warnings", ""] + [f"- {md_escape(w)}" for w in record.warnings] + [""]
    return "\n".join(out).rstrip("\n")


def _findings(findings) -> list:
    if not findings:
        return ["No findings.", ""]
    out = [f"#### Findings ({len(findings)})", ""]
    for f in findings:
        where = f" at {_code(f.location)}" if f.location else ""
        module = f" in module {_code(f.module or '(root)')}" if f.module is not None else ""
        line = f"- {_MARKERS.get(f.severity, f.severity)} {_code(f.rule)}{module}{where}: "
        out.append(line + md_escape(with_hint(f.message, f.hint)))
    return out + [""]


def _code(text) -> str:
    return "`" + " ".join(str(text).replace("`", "'").splitlines()) + "`"


def _layers(record, depth) -> str:
    rows = []
    for m in module_rows(record, depth):
        name = m["name"] or "(root)"
        rows.append(["\u00a0\u00a0" * max(m["depth"] - 1, 0) + name if m["name"] else name, m["type"],
                     fmt_count(m["params"]) if m["params"] else "-", fmt_count(m["flops_forward"]),
                     fmt_count(m["flops_backward"]), f"{100 * m['flops_share']:.1f}%",
                     fmt_bytes(m["activation_bytes"], binary=True), fmt_bytes(m["peak_bytes"], binary=True),
                     m["copies"] or "-"])
    return md_table(["module", "type", "params", "fwd FLOPs", "bwd FLOPs", "share", "activations",
                     "peak", "copies"], rows, "llrrrrrrr")


def _copies(record) -> list:
    copies = record.copies
    if not copies:
        return []
    rows = [[c.get("reason", ""), c.get("module") or "(root)", c.get("phase", ""), c.get("location") or "-",
             c.get("count", 0), fmt_bytes(c.get("bytes", 0), binary=True)] for c in copies[:10]]
    more = [f"... and {len(copies) - 10} more.", ""] if len(copies) > 10 else []
    return ["#### Copies", "", md_table(["reason", "module", "phase", "location", "count", "bytes"],
                                        rows, "llllrr"), ""] + more
