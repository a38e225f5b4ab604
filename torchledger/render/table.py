"""The per-layer report for terminals: plain text (tabulate), fits 100 columns at depth 2.

    >>> print(render_table(t.record, t.findings(), depth=2))

No colors: the text is the same on a terminal, in a file and in CI logs.
"""
from __future__ import annotations

from tabulate import tabulate

from ..record import counts_samples
from ..units import fmt_bytes, fmt_count
from .collectives import collective_lines
from .steptime import fmt_seconds
from .common import (CONVENTIONS_LINE, EMPTY_SENTENCE, as_findings, attention_kernels, attention_text, dtype_text,
                     is_empty, module_rows, run_notes, tokens_note)

__all__ = ["render_table"]

_HEADERS = ["module", "type", "params", "fwd FLOPs", "bwd FLOPs", "share", "activations", "peak",
            "copies"]


def render_table(record, findings=(), *, depth: int = 2, width: int = 100, **_options) -> str:
    """Per-layer table (modules down to ``depth``), totals, memory and findings.

    ``findings=None`` renders the record's own findings. ``width`` is accepted for callers
    that pass it; the columns at the default depth fit 100 characters.
    """
    if is_empty(record):
        return EMPTY_SENTENCE
    findings = as_findings(record, findings)
    m = record.meta
    lines = [
        f"torchledger step report: {m.get('model') or 'model'} on {m.get('device', '?')}"
        f" ({dtype_text(record)}), torch {m.get('torch', '?')}",
        f"attention kernel: {attention_kernels(record)}",
        f"conventions: {CONVENTIONS_LINE}",
        *run_notes(record),
        "",
        tabulate(_module_cells(record, depth), headers=_HEADERS + (["pred time"] if _predicted(record) else []),
                 tablefmt="simple", disable_numparse=True),
    ]
    lines += _totals_lines(record)
    lines += collective_lines(record)          # distributed records only
    lines += _comparison_lines(record)
    if findings:
        lines += ["", "findings:"]
        for fd in findings:
            where = f" [{fd.location}]" if fd.location else (f" [{fd.module}]" if fd.module else "")
            lines.append(f"  {fd.severity:7s} {fd.rule}{where}: {fd.message}")
            if fd.hint:
                lines.append(f"          hint: {fd.hint}")
    for w in record.warnings[:5]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _module_cells(record, depth) -> list:
    rows = []
    for mod in module_rows(record, depth):
        name = mod["name"] or "(root)"
        indent = "  " * max(mod["depth"] - 1, 0) if mod["name"] else ""
        rows.append([indent + name, mod["type"],
                     fmt_count(mod["params"]) if mod["params"] else "-",
                     fmt_count(mod["flops_forward"]), fmt_count(mod["flops_backward"]),
                     f"{100 * mod['flops_share']:.1f}%",
                     fmt_bytes(mod["activation_bytes"], binary=True),
                     fmt_bytes(mod["peak_bytes"], binary=True),
                     mod["copies"] or "-"] + ([fmt_seconds(mod.get("predicted_seconds"))]
                                              if _predicted(record) else []))
    return rows


def _predicted(record) -> bool:
    return bool((record.predictions or {}).get("step_time"))


def _in_parens(name: str) -> str:
    return name if name.startswith("(") and name.endswith(")") else f"({name})"


def _module_name(name) -> str:
    if name is None:
        return "-"
    return name or "(root)"


def _comparison_lines(record) -> list:
    """Predicted vs measured, each row with its ratio and the explanation of the gap."""
    rows = (record.predictions or {}).get("comparisons") or []
    if not rows:
        return []
    out = ["", "predicted vs measured:"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}x" if r.get("ratio") is not None else "n/a"
        out.append(f"  {r['quantity']:<42s} {_num(r['measured']):>20s} vs {_num(r['predicted']):>20s}  "
                   f"{ratio}")
        out.append(f"      {r.get('explanation', '')}")
    return out


def _num(x) -> str:
    return f"{x:,}" if isinstance(x, int) else (f"{x:,.4g}" if isinstance(x, float) else str(x))


def _totals_lines(record) -> list:
    t = record.totals
    f = t["flops"]
    elementwise = (t.get("elementwise_flops") or {}).get("total", 0)
    lines = [
        "",
        f"FLOPs: forward {fmt_count(f['forward'])}, backward {fmt_count(f['backward'])}, "
        f"optimizer {fmt_count(f['optimizer'])}, total {fmt_count(f['total'])} ({f['total']:,})",
        f"attention: {attention_text(record)}; element-wise (not in total): {fmt_count(elementwise)}",
    ]
    note = tokens_note(t)               # where D came from (absent from older records)
    if t.get("tokens"):
        n = t.get("matmul_params", 0)
        per = "sample" if counts_samples(t) else "token"
        source = f" ({note})" if note else ""
        six = "" if counts_samples(t) else f"; 6ND (N = {n:,} matmul params) = {6 * n * t['tokens']:,}"
        lines.append(f"tokens: {t['tokens']:,}{source}; FLOPs/{per} {f['total'] / t['tokens']:,.0f}{six}")
    elif note:
        lines.append(f"tokens: none ({note}); no FLOPs/token or 6ND")
    pb = record.memory.get("peak_breakdown", {})
    lines.append(f"memory: peak {fmt_bytes(t['peak_bytes'], binary=True)} in {t.get('peak_phase') or '?'}"
                 f" {_in_parens(_module_name(t.get('peak_module')))}: " +
                 ", ".join(f"{k} {fmt_bytes(v, binary=True)}" for k, v in pb.items() if v))
    lines.append(f"activations saved: {fmt_bytes(t['activation_bytes'], binary=True)}; optimizer state "
                 f"{fmt_bytes(t['optimizer_state_bytes'], binary=True)}; copies "
                 f"{fmt_bytes(t.get('copy_bytes', 0), binary=True)}")
    if t.get("step_seconds") is not None:
        simulated = str(record.meta.get("device", "")).startswith(("fake", "meta"))
        note = " (traced; fake/meta: not a real step time)" if simulated else " (traced)"
        untraced = (f"{t['step_seconds_untraced'] * 1e3:.1f} ms untraced, "
                    if t.get("step_seconds_untraced") else "")
        lines.append(f"step time: {untraced}{t['step_seconds'] * 1e3:.1f} ms{note}")
    alloc = record.memory.get("allocator")
    if alloc:
        if alloc.get("available"):
            sm = alloc["summary"]
            lines.append(f"CUDA allocator: reserved {fmt_bytes(sm['reserved_bytes'], binary=True)}, allocated "
                         f"{fmt_bytes(sm['allocated_bytes'], binary=True)}, largest free block "
                         f"{fmt_bytes(sm['largest_free_bytes'], binary=True)}, fragmentation "
                         f"{sm['fragmentation']:.2f}")
        else:
            lines.append(f"CUDA allocator: {alloc.get('reason')}")
    unc = record.uncounted_ops
    if unc:
        lines.append("uncounted ops (no FLOP formula; not in totals): " +
                     ", ".join(f"{u['op']} x{u['count']}" for u in unc[:8]) +
                     (" ..." if len(unc) > 8 else ""))
    return lines
