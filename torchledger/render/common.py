"""Pieces every renderer shares: emptiness, findings, module selection, number cells.

Renderers read records through ``.get(key, default)`` so a record saved by an older
version, or one loaded back from JSON, renders the same as a fresh one.
"""
from __future__ import annotations

from ..record import (TOKENS_FROM_SPEC, TOKENS_GIVEN, Finding, attention_ran_causal, compute_dtype,
                      counts_samples)
from ..record.finding import EMPTY_SENTENCE, as_findings, is_empty  # noqa: F401  (re-exported)
from ..units import fmt_bytes, fmt_count, fmt_mfu

__all__ = ["EMPTY_SENTENCE", "is_empty", "as_findings", "module_rows", "frontier", "title",
           "kernel_line", "CONVENTIONS_LINE", "comparison_rows", "fmt_value", "SEVERITY_ORDER",
           "totals_rows", "measured_static_bytes", "with_hint", "tokens_note", "attention_kernels",
           "NO_ATTENTION_KERNEL", "run_notes", "mfu_line", "dtype_text", "attention_text", "tool_version"]

CONVENTIONS_LINE = ("FLOP = 2 x multiply-add; totals count matmul-class work; attention counted dense "
                    "(no causal discount; causal kernels' halved count beside it); element-wise FLOPs "
                    "listed apart")
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}

#: What each prediction key is compared with, when the analyzers attached no ``comparisons``.
_MEASURED_FOR = {
    "flops_6nd": ("training FLOPs", lambda r: r.totals["flops"]["total"]),
    "flops_6nd_attention": ("training FLOPs", lambda r: r.totals["flops"]["total"]),
    "params_12ld2": ("parameters", lambda r: r.totals["params"]),
    "static_bytes": ("static memory", lambda r: measured_static_bytes(r)),
}


def measured_static_bytes(record) -> int:
    """Most parameter + gradient + optimizer-state bytes live at once (gradients are gone
    after ``zero_grad(set_to_none=True)``, so the end-of-step totals undercount)."""
    rows = (record.memory or {}).get("timeline") or []
    keys = ("parameters", "gradients", "optimizer_state")
    if rows:
        return max(sum(r.get(k, 0) for k in keys) for r in rows)
    t = record.totals
    return t["param_bytes"] + t["grad_bytes"] + t["optimizer_state_bytes"]


def title(record) -> str:
    m = record.meta
    if not m.get("model") and not m.get("device"):
        return "torchledger step report"
    return f"torchledger step report: {m.get('model') or 'model'} on {m.get('device') or '?'}"


NO_ATTENTION_KERNEL = ("none seen (attention written as plain matmuls, e.g. nn.MultiheadAttention "
                       "with need_weights=True, is counted as matmul)")


def attention_kernels(record) -> str:
    """The attention kernels a record's numbers describe, for the report's header."""
    kernels = record.meta.get("attention_kernels")
    return ", ".join(kernels) if kernels else NO_ATTENTION_KERNEL


def dtype_text(record) -> str:
    """The parameters' dtype, and the compute dtype as measured (:func:`compute_dtype`: the
    dtype of most matmul FLOPs) with what set it, when it differs: ``float32 weights,
    bfloat16 compute (--precision bf16-mixed)`` for FSDP's MixedPrecisionPolicy or autocast."""
    dtype = (record.meta or {}).get("dtype") or "?"
    compute, how = compute_dtype(record)
    if dtype == "?" or compute == dtype:
        return dtype
    return f"{dtype} weights, {compute} compute " + ("as its matmuls ran" if how == "matmuls" else f"under {how}")


def attention_text(record) -> str:
    """The step's attention FLOPs as the totals state them: counted dense (the 6ND
    convention), and the causal-halved count only where a kernel ran causal
    (:func:`attention_ran_causal`); a UNet's or an encoder's attention says it ran dense."""
    attn = (record.totals or {}).get("attention_flops") or {}
    dense, causal = int(attn.get("dense") or 0), int(attn.get("causal") or 0)
    ran = attention_ran_causal(record)
    if ran is None:
        return "0 (no attention kernel ran; attention written as matmuls is in the matmul count)"
    if causal < dense:
        return f"{fmt_count(dense)} counted dense, {fmt_count(causal)} with the causal kernels' masked half left out"
    if ran:
        return (f"{fmt_count(dense)} counted dense (the kernels took an explicit causal mask, not is_causal: "
                f"nothing halved)")
    return f"{fmt_count(dense)} counted dense (no kernel ran causal: nothing to halve)"


def kernel_line(record) -> str:
    m = record.meta
    kernel = attention_kernels(record)
    return (f"device {m.get('device', '?')}, dtype {dtype_text(record)}, torch {m.get('torch', '?')}; "
            f"attention kernel: {kernel}")


def run_notes(record) -> list:
    """Lines every report prints under its header: how the step was run and measured (the
    loss an audit backpropagated, ...). Absent fields (older records, a ``trace()`` of the
    user's own step) print nothing."""
    meta = record.meta or {}
    audit = meta.get("audit") or {}
    lines = []
    if audit.get("world_size"):              # audit --world-size N: a simulated world
        mesh = "x".join(str(d) for d in audit.get("mesh") or [audit["world_size"]])
        lines.append(f"simulated world: rank {audit.get('rank', 0)} of {audit['world_size']} (mesh {mesh}; "
                     f"fake tensors, fake process group); ranks of an SPMD step are alike, so this "
                     f"is each rank's report")
    if audit.get("loss"):
        lines.append(f"loss: {audit['loss']}")
    pipe = pipeline_line(record.totals)
    if pipe:
        lines.append(pipe)
    compiled = meta.get("compiled") or {}
    if compiled:
        where = ", ".join(compiled.get("modules") or []) or "compiled functions"
        lines.append(f"torch.compile ({where}; {compiled.get('calls', 0)} call(s) of compiled code): "
                     f"{compiled.get('note') or 'the traced step ran eagerly'}")
    gpu = meta.get("gpu_kernels") or {}
    if gpu:
        lines.append("fake tensors run the GPU's kernels where CPU's keep other tensors for backward: "
                     + "; ".join(f"{v.get('note', k)} x{v.get('calls', 0)}" for k, v in gpu.items()))
    cast = meta.get("autocast") or {}
    if cast.get("dtype"):
        lines.append(f"autocast: the step computes in {cast['dtype']} ({cast.get('device_type', '?')} "
                     f"autocast); parameters, gradients and optimizer state stay {meta.get('dtype') or '?'}")
    mfu = mfu_line(record.totals)
    if mfu:
        lines.append(mfu)
    from .steptime import step_time_lines          # audit --gpu: predicted step time
    lines += step_time_lines(record)
    hidden = meta.get("suppressed") or {}
    if hidden.get("ignore"):
        rules = ", ".join(f"{r} x{n}" for r, n in (hidden.get("rules") or {}).items())
        lines.append(f"suppressed: {hidden.get('count', 0)} finding(s)" + (f" ({rules})" if rules else "")
                     + f" by ignore = {', '.join(hidden['ignore'])}; they do not count for --fail-on")
    return lines


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"{rs[0]}-{rs[-1]}" if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)) else ", ".join(map(str, rs))


def pipeline_line(totals):
    """A pipeline audit's record is its bounding stage's: which one, what it holds, and every
    stage's peak (``totals.pipeline``); None for other records."""
    pp = totals.get("pipeline")
    if not isinstance(pp, dict) or not isinstance(pp.get("per_stage"), list) or not pp["per_stage"]:
        return None
    stages = pp["per_stage"]
    bound = next((s for s in stages if s.get("rank") == pp.get("bounding_rank")), stages[0])
    ends = [e for e, k in (("the embedding", "embedding"), ("the head", "head")) if bound.get(k)]
    holds = f"{bound.get('blocks', '?')} blocks" + (" and " + " and ".join(ends) if ends else "")
    peaks = ", ".join(f"{_ranks(s.get('ranks_alike') or [s.get('rank')])} {fmt_bytes(s.get('peak_bytes') or 0, True)}"
                      for s in stages)
    return (f"pipeline: {pp.get('stages')} stages x {pp.get('virtual_stages', 1)} virtual, "
            f"{pp.get('micro_batches')} micro-batches, {pp.get('schedule')} (bubble "
            f"{float(pp.get('bubble_fraction') or 0):.3f}); this report is stage {bound.get('rank')}'s, the largest "
            f"peak ({holds}); peak per stage: {peaks}; totals are the step's (m micro-batches), the module "
            f"table's peaks and activations one traced micro-step's")


def mfu_line(totals):
    """The report's one MFU, with the steps it comes from, or why there is none; None for a
    record that has neither (made before ``mfu_source`` existed, with no MFU)."""
    m, source = totals.get("mfu"), totals.get("mfu_source")
    if m is None:
        return f"MFU: {source}" if source else None
    hfu = f" (HFU {fmt_mfu(totals['hfu'])})" if totals.get("hfu") is not None else ""
    return f"MFU: {fmt_mfu(m)}{hfu} from {source or 'a source not recorded'}"


def module_rows(record, depth) -> list:
    """Modules down to ``depth`` (``None``: all), with every field the renderers read."""
    rows = []
    for mod in record.modules:
        d = mod.get("depth", 0)
        if depth is not None and d > depth:
            continue
        row = {"name": mod.get("name", ""), "type": mod.get("type", ""), "depth": d}
        for key in ("params", "flops_forward", "flops_backward", "activation_bytes", "peak_bytes",
                    "copies", "copy_bytes", "calls"):
            row[key] = mod.get(key, 0) or 0
        row["flops_share"] = mod.get("flops_share", 0.0) or 0.0
        if "predicted_seconds" in mod:               # audit --gpu
            row["predicted_seconds"] = mod["predicted_seconds"]
        rows.append(row)
    return rows


def frontier(record, depth: int) -> list:
    """Rows that partition the model at ``depth``: modules at ``depth``, shallower leaves, and
    for a shallower module with children, its own ops as a row ``"<name> (own ops)"``.

    ``(no module)`` work (ops outside every module) is kept as its own row. The FLOPs and
    activation bytes of the rows add up to the root's (plus ``(no module)``'s).
    """
    rows = module_rows(record, None)
    out = []
    for r in rows:
        if r["name"] == "(no module)" or r["depth"] == depth:
            out.append(r)
        elif r["depth"] < depth:
            kids = [c for c in rows if c["depth"] == r["depth"] + 1 and c["name"] != "(no module)"
                    and (r["name"] == "" or c["name"].startswith(r["name"] + "."))]
            if not kids:
                out.append(r)
                continue
            own = dict(r, name=f"{r['name'] or '(root)'} (own ops)")
            for key in ("flops_forward", "flops_backward", "activation_bytes"):
                own[key] = r[key] - sum(c[key] for c in kids)
            if own["flops_forward"] or own["flops_backward"] or own["activation_bytes"]:
                out.append(own)
    return out


def with_hint(message: str, hint) -> str:
    """``message`` followed by ``Hint: ...`` as a sentence of its own."""
    if not hint:
        return message
    sep = " " if message.rstrip().endswith((".", "!", "?")) else ". "
    return f"{message.rstrip()}{sep}Hint: {hint}"


def fmt_value(key: str, value) -> str:
    """A number for a human: bytes for ``*_bytes`` keys, ``6.74B (6,738,415,616)`` for counts."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if "bytes" in key:
        return fmt_bytes(value, binary=True)
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4g}"
    value = int(value)
    return f"{fmt_count(value)} ({value:,})" if abs(value) >= 1000 else str(value)


def comparison_rows(record) -> list:
    """Rows of ``{quantity, measured, predicted, ratio, explanation}`` (strings).

    The analyzers' ``predictions["comparisons"]`` are shown as they are; without them, each
    known prediction is set beside the measured figure it predicts.
    """
    preds = record.predictions or {}
    comparisons = preds.get("comparisons") or []
    rows = []
    if comparisons:
        for c in comparisons:
            q = str(c.get("quantity", "?"))
            key = q + (" bytes" if c.get("unit") in ("bytes", "B") else "")
            ratio = c.get("ratio")
            rows.append({"quantity": q, "measured": fmt_value(key, c.get("measured")),
                         "predicted": fmt_value(key, c.get("predicted")),
                         "ratio": f"{ratio:.3f}" if isinstance(ratio, (int, float)) else "-",
                         "explanation": str(c.get("explanation") or "")})
        return rows
    for key, predicted in preds.items():
        if key == "comparisons" or isinstance(predicted, (dict, list)):
            continue
        label, get = _MEASURED_FOR.get(key, (None, None))
        measured = get(record) if get else None
        ratio = measured / predicted if measured is not None and predicted else None
        rows.append({"quantity": f"{label} ({key})" if label else key,
                     "measured": fmt_value(key, measured), "predicted": fmt_value(key, predicted),
                     "ratio": f"{ratio:.3f}" if ratio is not None else "-", "explanation": ""})
    return rows


def tokens_note(totals) -> str | None:
    """Where D (tokens per step) came from, for the tokens line: ``totals.tokens_source``, and
    how to set it when the audit inferred it from the inputs. None for records without a
    source (made before the field existed, or traced with no tokens)."""
    src = totals.get("tokens_source")
    if not src:
        return None
    if src in (TOKENS_GIVEN, TOKENS_FROM_SPEC):
        return src
    return f"{src}; pass AuditSpec(tokens=...) to set it"


def totals_rows(record) -> list:
    """``[label, value]`` pairs (strings) summarising the step, for the markdown and HTML totals."""
    t = record.totals
    f = t["flops"]
    attn = t.get("attention_flops") or {}
    rows = [["parameters", f"{fmt_count(t['params'])} ({t['params']:,})"]]
    note = tokens_note(t)
    if t.get("tokens") or note:
        count = f"{t['tokens']:,}" if t.get("tokens") else "none"
        rows.append(["tokens per step", count + (f" ({note})" if note else "")])
    rows += [["FLOPs forward / backward / optimizer",
              f"{fmt_count(f['forward'])} / {fmt_count(f['backward'])} / {fmt_count(f['optimizer'])}"],
             ["FLOPs total (matmul-class)", f"{fmt_count(f['total'])} ({f['total']:,})"]]
    if attn.get("dense"):
        rows.append(["attention FLOPs", attention_text(record)])
    rows.append(["element-wise FLOPs (not in total)",
                 fmt_count((t.get("elementwise_flops") or {}).get("total", 0))])
    if t.get("tokens"):
        rows.append([f"FLOPs per {'sample' if counts_samples(t) else 'token'}",
                     f"{f['total'] / t['tokens']:,.0f}"])
    phase, module = t.get("peak_phase"), t.get("peak_module")
    peak_at = ", ".join(x for x in (phase, module if module != f"({phase})" else None) if x)
    rows.append(["peak live memory", fmt_bytes(t["peak_bytes"], binary=True) + (f" ({peak_at})" if peak_at else "")])
    pb = record.memory.get("peak_breakdown") or {}
    if any(pb.values()):
        rows.append(["at peak", ", ".join(f"{k} {fmt_bytes(v, binary=True)}" for k, v in pb.items() if v)])
    for label, key in (("activations saved", "activation_bytes"), ("parameters", "param_bytes"),
                       ("gradients", "grad_bytes"), ("optimizer state", "optimizer_state_bytes"),
                       ("copies", "copy_bytes")):
        rows.append([label + " (bytes)", fmt_bytes(t.get(key, 0), binary=True)])
    if t.get("step_seconds") is not None:
        rows.append(["step time (traced)", f"{t['step_seconds'] * 1e3:.1f} ms"])
    return rows


def tool_version() -> str:
    """torchledger's version, read when a report is written (a test pins it for the goldens)."""
    from .. import __version__  # read at call time: the root attribute may be replaced
    return __version__
