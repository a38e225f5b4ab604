"""Render a merge of ranks' records (:func:`torchledger.analyzers.ranks.merge_ranks`).

    >>> print(render_ranks(merge_ranks(records, names), "table"))

Formats: ``table`` (terminal text), ``json`` (the merge as one object, schema
``torchledger.ranks/1``), ``csv`` (one row per rank), ``markdown`` and ``sarif`` (the
merge's findings). One record's report is :func:`torchledger.render.render`'s, unchanged.
"""
from __future__ import annotations

import json

from tabulate import tabulate

from ..units import fmt_bytes, fmt_count, printable
from .data import csv_cell
from .markdown import md_escape, md_table
from .sarif import findings_to_sarif
from .common import tool_version

__all__ = ["render_ranks", "RANK_FORMATS", "RANK_COLUMNS"]

RANK_COLUMNS = ["rank", "file", "flops", "peak_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes",
                "comm_bytes", "step_seconds", "tokens"]
_HEADERS = ["rank", "FLOPs", "peak", "params", "grads", "optimizer", "comm", "step", "file"]
_SKEW_LABELS = {"flops": "FLOPs", "peak_bytes": "peak bytes", "comm_bytes": "comm bytes",
                "step_seconds": "step time"}
_NO_COMM = "not in these records (made before torchledger counted collectives)"


def render_ranks(merged: dict, fmt: str = "table") -> str:
    """``merged`` in format ``fmt`` (a key of :data:`RANK_FORMATS`); no trailing newline."""
    try:
        renderer = RANK_FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"merged ranks render as {', '.join(RANK_FORMATS)}; got {fmt!r}") from None
    return renderer(merged)


def _json(merged) -> str:
    d = dict(merged, findings=[_finding_dict(f) for f in merged["findings"]])
    return json.dumps(d, indent=2)


def _finding_dict(f) -> dict:
    return f if isinstance(f, dict) else f.to_dict()


def _csv(merged) -> str:
    import pandas as pd
    rows = [{k: csv_cell(row.get(k)) for k in RANK_COLUMNS} for row in merged["ranks"]]
    return pd.DataFrame(rows, columns=RANK_COLUMNS).to_csv(index=False, lineterminator="\n").rstrip("\n")


def _cells(row) -> list:
    comm = row["comm_bytes"]
    secs = row["step_seconds"]
    return [row["rank"], fmt_count(row["flops"]), fmt_bytes(row["peak_bytes"], binary=True),
            fmt_bytes(row["param_bytes"], binary=True), fmt_bytes(row["grad_bytes"], binary=True),
            fmt_bytes(row["optimizer_state_bytes"], binary=True),
            "-" if comm is None else fmt_bytes(comm, binary=True), "-" if secs is None else f"{secs:.3g} s",
            printable(row["file"])]                     # a newline in a file name stays in its row


def _headline(merged) -> str:
    n, world = len(merged["ranks"]), merged["world_size"]
    mesh = merged.get("mesh")
    mesh_text = f", mesh {list(mesh)}" if mesh else ""
    return f"torchledger ranks report: {n} of {world} ranks (world size {world}{mesh_text})"


def _notes(merged) -> list:
    missing = merged["missing_ranks"]
    if not missing:
        return []
    count = merged.get("missing_count", len(missing))
    shown = ", ".join(str(r) for r in missing[:16]) + (", ..." if count > 16 else "")
    return [f"missing ranks: {shown} ({count} of {merged['world_size']}); "
            f"skew and findings describe the ranks given"]


def _skew_notes(merged) -> list:
    notes = []
    for key, label in _SKEW_LABELS.items():
        if merged["skew"][key]["max"] is None:
            what = _NO_COMM if key == "comm_bytes" else "not measured"
            notes.append(f"{label}: {what}")
    return notes


def _skew_lines(merged) -> list:
    out = []
    for key, label in _SKEW_LABELS.items():
        s = merged["skew"][key]
        if s["max"] is None:
            out.append([label, "-", "-", "-", "-"])
            continue
        show = _show(key)
        out.append([label, f"{show(s['max'])} (rank {s['max_rank']})", f"{show(s['min'])} (rank {s['min_rank']})",
                    _ratio(s["max_over_min"]), _ratio(s["max_over_median"])])
    return out


def _show(key):
    if key == "flops":
        return fmt_count
    if key == "step_seconds":
        return lambda s: f"{s:.3g} s"
    return lambda b: fmt_bytes(b, binary=True)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _table(merged) -> str:
    lines = [_headline(merged), *_notes(merged), "",
             tabulate([_cells(r) for r in merged["ranks"]], headers=_HEADERS, tablefmt="simple",
                      disable_numparse=True, colalign=("right",) * 8 + ("left",)),
             "", "skew across ranks:",
             tabulate(_skew_lines(merged), headers=["", "max", "min", "max/min", "max/median"],
                      tablefmt="simple", disable_numparse=True),
             *_skew_notes(merged)]
    findings = [_finding_dict(f) for f in merged["findings"]]
    if findings:
        lines += ["", "findings:"]
        for f in findings:
            lines.append(f"  {f['severity']:7s} {f['rule']}: {printable(f['message'])}")
            if f.get("hint"):
                lines.append(f"          hint: {printable(f['hint'])}")
    else:
        lines += ["", "No findings: no rank stands out."]
    return "\n".join(lines)


def _markdown(merged) -> str:
    out = [f"### {md_escape(_headline(merged))}", ""]
    out += [line for note in _notes(merged) for line in (md_escape(note), "")]
    findings = [_finding_dict(f) for f in merged["findings"]]
    if findings:
        out += [f"#### Findings ({len(findings)})", ""]
        for f in findings:
            hint = f" (hint: {f['hint']})" if f.get("hint") else ""
            out.append(f"- **[{f['severity']}]** `{f['rule']}`: {md_escape(f['message'] + hint)}")
        out.append("")
    else:
        out += ["No findings: no rank stands out.", ""]
    out += ["#### Per rank", "", md_table(_HEADERS, [_cells(r) for r in merged["ranks"]], "rrrrrrrrl"), ""]
    out += ["#### Skew across ranks", "",
            md_table(["quantity", "max", "min", "max/min", "max/median"], _skew_lines(merged), "lrrrr")]
    out += [line for note in _skew_notes(merged) for line in ("", md_escape(note))]
    return "\n".join(out)


def _sarif(merged) -> str:
    log = findings_to_sarif(merged["findings"], tool_version(), notifications=_notes(merged))
    return json.dumps(log, indent=2, default=str)


RANK_FORMATS = {"table": _table, "json": _json, "csv": _csv, "markdown": _markdown, "sarif": _sarif}
