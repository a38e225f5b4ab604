"""Renderers: ``render(record, findings) -> str``; the caller prints.

``render_table`` is the per-layer report for terminals (tabulate, fits 100 columns at the
default depth).
"""
from __future__ import annotations

from tabulate import tabulate

from .units import fmt_bytes, fmt_count

__all__ = ["render_table"]


def render_table(record, findings=(), *, depth: int = 2, width: int = 100) -> str:
    """Per-layer table (modules down to ``depth``), totals, memory and findings."""
    t = record.totals
    if not record.modules and not t["flops"]["total"] and not record.ops:
        return "Empty record: no ops were traced (did the traced block run a step?)."
    m = record.meta
    lines = [
        f"torchledger step report: {m.get('model') or 'model'} on {m.get('device', '?')}"
        f" ({m.get('dtype') or '?'}), torch {m.get('torch', '?')}",
        f"attention kernel: {', '.join(m['attention_kernels']) if m.get('attention_kernels') else 'none seen (math path counts as matmul)'}",
        "conventions: FLOP = 2 x multiply-add; totals count matmul-class work; attention dense "
        "(causal-halved beside it); element-wise FLOPs listed apart",
        "",
    ]
    rows = []
    for mod in record.modules:
        if mod["depth"] > depth:
            continue
        name = mod["name"] or "(root)"
        rows.append([("  " * max(mod["depth"] - 1, 0) if mod["name"] else "") + name, mod["type"],
                     fmt_count(mod["params"]) if mod["params"] else "-",
                     fmt_count(mod["flops_forward"]), fmt_count(mod["flops_backward"]),
                     f"{100 * mod['flops_share']:.1f}%",
                     fmt_bytes(mod["activation_bytes"], binary=True),
                     fmt_bytes(mod["peak_bytes"], binary=True),
                     mod["copies"] or "-"])
    lines.append(tabulate(rows, headers=["module", "type", "params", "fwd FLOPs", "bwd FLOPs", "share",
                                         "activations", "peak", "copies"],
                          tablefmt="simple", disable_numparse=True))
    f = t["flops"]
    lines += [
        "",
        f"FLOPs: forward {fmt_count(f['forward'])}, backward {fmt_count(f['backward'])}, "
        f"optimizer {fmt_count(f['optimizer'])}, total {fmt_count(f['total'])} "
        f"({f['total']:,})",
        f"attention: {fmt_count(t['attention_flops']['dense'])} dense, "
        f"{fmt_count(t['attention_flops']['causal'])} causal-halved; "
        f"element-wise (not in total): {fmt_count(t['elementwise_flops']['total'])}",
    ]
    if t.get("tokens"):
        lines.append(f"tokens: {t['tokens']:,}; FLOPs/token {t['flops']['total'] / t['tokens']:,.0f}; "
                     f"6ND (N = {t['matmul_params']:,} matmul params) = "
                     f"{6 * t['matmul_params'] * t['tokens']:,}")
    mem = record.memory
    pb = mem.get("peak_breakdown", {})
    lines.append(f"memory: peak {fmt_bytes(t['peak_bytes'], binary=True)} in {t.get('peak_phase') or '?'}"
                 f" ({t.get('peak_module') or '-'}): " +
                 ", ".join(f"{k} {fmt_bytes(v, binary=True)}" for k, v in pb.items() if v))
    lines.append(f"activations saved: {fmt_bytes(t['activation_bytes'], binary=True)}; optimizer state "
                 f"{fmt_bytes(t['optimizer_state_bytes'], binary=True)}; copies "
                 f"{fmt_bytes(t['copy_bytes'], binary=True)}")
    if t.get("step_seconds") is not None:
        mfu = f", MFU {t['mfu']:.3f}" if t.get("mfu") is not None else ""
        lines.append(f"step time: {t['step_seconds'] * 1e3:.1f} ms (traced){mfu}")
    if record.uncounted_ops:
        lines.append("uncounted ops (no FLOP formula; not in totals): " +
                     ", ".join(f"{u['op']} x{u['count']}" for u in record.uncounted_ops[:8]) +
                     (" ..." if len(record.uncounted_ops) > 8 else ""))
    if findings:
        lines += ["", "findings:"]
        for fd in findings:
            where = f" [{fd.location}]" if fd.location else (f" [{fd.module}]" if fd.module else "")
            lines.append(f"  {fd.severity:7s} {fd.rule}{where}: {fd.message}")
    for w in record.warnings[:5]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
