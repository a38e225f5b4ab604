"""The "predicted step time" lines every report prints under its header (``audit --gpu``).

    >>> print("\\n".join(step_time_lines(record)))

A record without ``predictions.step_time`` prints nothing (its report is unchanged).
"""
from __future__ import annotations

from ..units import fmt_mfu

__all__ = ["step_time_lines", "fmt_seconds", "setup_line"]


def fmt_seconds(s) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.1f} ms"
    return f"{s * 1e6:,.0f} us"


def _precision(record) -> tuple:
    """(what the step computes in, whether that is plain fp32): ``--precision`` as the audit
    applied it, else autocast seen in the step, else the weights' dtype."""
    meta = record.meta or {}
    applied = (meta.get("audit") or {}).get("precision")
    if applied:                         # the layout's default is fp32: asked for or not
        return applied, applied == "fp32"
    auto = meta.get("autocast") or {}
    if auto.get("dtype"):
        return f"autocast {auto['dtype']}", False
    dtype = str(meta.get("dtype") or "float32").replace("torch.", "")
    return {"float32": "fp32"}.get(dtype, dtype), dtype == "float32"


def setup_line(record, p) -> str:
    """One short line: the precision, kernels and layout the prediction prices."""
    audit = (record.meta or {}).get("audit") or {}
    kernels = audit.get("kernels") or ("compiled" if p.get("compiled") else "eager")
    dims = (record.totals or {}).get("parallel_dims")
    world = audit.get("world_size") or (record.totals or {}).get("world_size") or 1
    mesh = [int(n) for n in audit.get("mesh") or [] if isinstance(n, int)]
    if isinstance(dims, dict) and any(int(v or 1) > 1 for v in dims.values()):
        layout = " x ".join(f"{k} {v}" for k, v in dims.items() if int(v or 1) > 1) + f" ({world} GPUs)"
    elif len(mesh) > 1:                 # the spec's own plan over a mesh
        layout = "mesh " + " x ".join(map(str, mesh)) + f" ({world} GPUs)"
    else:
        layout = f"{world} GPU{'s' if world != 1 else ''}"
    return f"as: precision {_precision(record)[0]}, kernels {kernels}, layout {layout}"


def step_time_lines(record) -> list:
    p = (getattr(record, "predictions", None) or {}).get("step_time")
    if not isinstance(p, dict) or not isinstance(p.get("seconds"), (int, float)):
        return []
    m = p.get("micro_batches") or 1
    rate = p.get("tokens_per_s_per_gpu")
    head = (f"predicted step time on {p.get('gpu')}: {fmt_seconds(p['seconds'])}"
            f" ({m} micro-batch{'es' if m != 1 else ''}"
            f"{', compiled' if p.get('compiled') else ''})")
    if rate:
        head += f", {rate:,.0f} tokens/s per GPU"
    if p.get("mfu") is not None:
        head += f", MFU {fmt_mfu(p['mfu'])}"
        if p.get("hfu") is not None:
            head += f" (HFU {fmt_mfu(p['hfu'])})"
    lines = [head, "  " + setup_line(record, p)]
    if _precision(record)[1]:
        lines.append("  fp32 training, priced at the fp32 peak: for mixed precision ask --precision bf16-mixed")
    phases = p.get("by_phase") or {}
    comm = p.get("comm_seconds") or 0
    text = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in phases.items() if v)
    text += f"; communication {fmt_seconds(comm)}, {fmt_seconds(p.get('comm_exposed_seconds') or 0)} exposed"
    if p.get("bubble_seconds"):
        text += f"; pipeline bubble {fmt_seconds(p['bubble_seconds'])}"
    lines.append(f"  time per phase: {text}")
    lines.append(f"  where the time goes: {p.get('bound', '-')}")
    if p.get("measured_seconds"):
        ratio = p.get("predicted_over_measured")      # null where the schema allows it
        lines.append(f"  measured {fmt_seconds(p['measured_seconds'])}: predicted / measured "
                     f"{f'{ratio:.2f}' if isinstance(ratio, (int, float)) else '-'}")
    if p.get("assumptions"):
        lines.append("  assumes: " + "; ".join(p["assumptions"]))
    return lines
