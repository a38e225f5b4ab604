"""``torchledger plan``'s result (a plain dict: INTERFACE's "Plan" JSON) as a table, JSON,
markdown or an HTML page with step time against peak memory drawn for every candidate."""
from __future__ import annotations

import json
from html import escape

from ..units import fmt_bytes, fmt_mfu

__all__ = ["render_plan", "plan_rows", "frontier"]

HEADER = ("#", "mesh", "mb x n", "ckpt", "schedule", "step", "tok/s/GPU", "MFU", "peak", "fits", "versus best")
#: Keys of the JSON a plan row keeps (INTERFACE), then the figures that explain it.
JSON_DROP = ("candidates",)


def render_plan(result: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps({k: v for k, v in result.items() if k not in JSON_DROP}, indent=2, sort_keys=False)
    if fmt == "markdown":
        return _markdown(result)
    if fmt == "html":
        return _html(result)
    return _table(result)


def _schedule(p: dict) -> str:
    if p["schedule"] is None:
        return "-"
    return p["schedule"] + (f" v={p['virtual_stages']}" if p["virtual_stages"] > 1 else "")


def plan_rows(result: dict) -> list:
    """The plans as rows of strings, in :data:`HEADER`'s order."""
    rows = []
    for i, p in enumerate(result["plans"], 1):
        rows.append((str(i), p["mesh"], f"{p['micro_batch_size']} x {p['micro_batches']}", p["checkpointing"],
                     _schedule(p), f"{p['step_seconds'] * 1e3:,.1f} ms", f"{p['tokens_per_s_per_gpu']:,.0f}",
                     fmt_mfu(p["mfu"]), fmt_bytes(p["peak_bytes"], binary=True), "yes" if p["fits"] else "no",
                     p["versus_best"]))
    return rows


def _lines(result: dict) -> list:
    """The sentences after the table: the search's size, the rejected, how to reproduce."""
    out = [f"{result['gpus']} x {result['gpu']}, global batch {result['global_batch']:,}: searched "
           f"{result['searched']:,} layouts, priced {result.get('composed', 0):,} from {result['traced']:,} "
           f"traces, in {result['seconds']:.0f} s; "
           f"memory limit {fmt_bytes(result['memory_limit_bytes'], binary=True)} a GPU"]
    if result["rejected"]:
        out.append("rejected:")
        for reason, n in sorted(result["rejected"].items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"  {n:>5,}  {reason}")
    over = [c for c in result.get("candidates", ()) if not c["fits"]]
    if over:
        near = min(over, key=lambda c: c["peak_bytes"])
        out.append(f"nearest miss: {near['mesh']} mb {near['micro_batch_size']} x {near['micro_batches']} "
                   f"{near['checkpointing']}: {fmt_bytes(near['peak_bytes'], binary=True)} on rank "
                   f"{near['peak_rank']}, {fmt_bytes(near['peak_bytes'] - result['memory_limit_bytes'], binary=True)} "
                   f"over the limit")
    if result["plans"]:
        best = result["plans"][0]
        out.append(f"reproduce #1: torchledger audit {result.get('file', 'FILE.py')} --gpu {result['gpu_flag']} "
                   f"--world-size {result['gpus']} {' '.join(best['audit_args'])}")
    else:
        out.append("no layout could be priced: see the reasons above")
    return out


def _table(result: dict) -> str:
    rows = [HEADER] + plan_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    text = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    if not result["plans"]:
        text = []
    return "\n".join(text + [""] + _lines(result))


def _markdown(result: dict) -> str:
    def row(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    text = [row(HEADER), "|" + "---|" * len(HEADER)] + [row(r) for r in plan_rows(result)]
    if not result["plans"]:
        text = []
    return "\n".join(text + [""] + [f"    {x}" if x.startswith("  ") else x for x in _lines(result)])


def frontier(candidates: list) -> set:
    """Indexes of the fitting candidates no other fitting one beats on both step time and peak."""
    fit = sorted((i for i, c in enumerate(candidates) if c["fits"]),
                 key=lambda i: (candidates[i]["peak_bytes"], candidates[i]["step_seconds"]))
    out, best = set(), float("inf")
    for i in fit:
        if candidates[i]["step_seconds"] < best:
            out.add(i)
            best = candidates[i]["step_seconds"]
    return out


def _html(result: dict) -> str:
    from .svg import scatter_chart
    cands = result.get("candidates", [])
    front = frontier(cands)
    points = [(c["peak_bytes"], c["step_seconds"],
               f"{c['mesh']} mb {c['micro_batch_size']}x{c['micro_batches']} {c['checkpointing']} "
               f"{_schedule(c)}: {c['step_seconds'] * 1e3:.1f} ms, {fmt_bytes(c['peak_bytes'], binary=True)}",
               "frontier" if i in front else "fits" if c["fits"] else "over") for i, c in enumerate(cands)]
    chart = scatter_chart(points, x_limit=result["memory_limit_bytes"],
                          title="predicted step time against peak memory, every candidate priced",
                          x_label="peak memory of the fullest rank", y_label="predicted step time")
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in plan_rows(result))
    notes = "".join(f"<li>{escape(x.strip())}</li>" for x in _lines(result))
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>torchledger plan</title>"
            f"<style>body{{font-family:system-ui,sans-serif}}td,th{{padding:2px 8px;text-align:left}}"
            f"</style></head><body>\n<h1>torchledger plan</h1>\n{chart}\n<p>Blue line: the frontier (no "
            f"fitting layout is both faster and smaller); red: over the memory limit.</p>\n"
            f"<table><tr>{head}</tr>{body}</table>\n<ul>{notes}</ul>\n</body></html>")
