"""Measured against closed forms: parameters, FLOPs, static bytes, activations.

Pure functions over a ``StepRecord`` (so they run offline on a saved JSON). Each comparison
row has a ratio (measured / predicted) and a named explanation of the gap. The closed forms
are those of :mod:`.params`, :mod:`.flops`, :mod:`.memory` and :mod:`.activations`.

    rows = comparisons(record)      # [{"quantity", "measured", "predicted", "ratio", "explanation"}]
    findings = check_comparisons([record], {"tolerance": 0.05})
"""
from __future__ import annotations

from ..record import Finding, counts_samples
from .activations import korthikanti_layer_bytes
from .memory import OPTIMIZERS, static_memory
from .params import count_params

__all__ = ["predictions", "comparisons", "check_comparisons"]

DEFAULT_TOLERANCE = 0.05


def _config(record):
    cfg = record.meta.get("config")
    if not cfg or cfg.get("kind") != "transformer" or cfg.get("partial"):
        return None
    try:
        from ..models.config import TransformerConfig
        keys = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "mlp", "norm",
                "bias", "tie_embeddings", "n_positions")
        return TransformerConfig(**{k: cfg[k] for k in keys if k in cfg})
    except (TypeError, ValueError):
        return None


#: Hugging Face model types whose parameters the decoder formula (ACCOUNTING section 6)
#: describes exactly. Others (q/k/v-only biases, multi-query with fused projections, experts,
#: encoder-decoder stacks, parallel blocks) get the 12Ld^2 approximation only, never an
#: "exact" row that is not.
EXACT_HF_TYPES = frozenset({"gpt2", "llama", "mistral"})


def _exact_formula_fits(cfg) -> bool:
    source = str((cfg or {}).get("source", ""))
    if source.startswith("huggingface:"):
        return (source.split(":", 1)[1] in EXACT_HF_TYPES
                and cfg.get("d_attn", cfg.get("d_model")) == cfg.get("d_model"))
    return True                      # torchledger's own configs and nanoGPT-style ones


def _uneven(p) -> bool:
    """Weights did not all multiply every token: 6 x sum(weight x rows) is not 6ND."""
    return p.get("flops_6nd_per_weight") is not None and p["flops_6nd_per_weight"] != p.get("flops_6nd")


def _shape(record):
    """(L, d, V, d_attn) of a recognised transformer, exact config or found from its modules;
    d_attn = heads x head dim, the width the attention term runs at (d unless the config
    sets a head_dim apart, as Gemma does)."""
    cfg = record.meta.get("config")
    if not cfg or cfg.get("kind") != "transformer":
        return None
    try:
        d = int(cfg["d_model"])
        return int(cfg["n_layers"]), d, int(cfg["vocab_size"]), int(cfg.get("d_attn") or d)
    except (KeyError, TypeError, ValueError):
        return None


def _seq_len(record):
    return (record.meta.get("audit") or {}).get("seq_len") or record.meta.get("seq_len")


def predictions(record) -> dict:
    """Closed-form predictions for what ``record`` measured (keys absent when not computable)."""
    t = record.totals
    out: dict = {}
    N, D = t.get("matmul_params", 0), t.get("tokens", 0)
    if D:
        out["flops_6nd"] = 6 * N * D
    if t.get("param_matmul_flops_forward"):
        # 6 x sum(P_i x rows_i): each weight times the rows it really multiplied. Equal to 6ND
        # when every weight sees every token; not for experts (top-k of E), encoder-decoder
        # stacks (their own lengths) or heads that read a few rows (a classifier's CLS token)
        out["flops_6nd_per_weight"] = 3 * int(t["param_matmul_flops_forward"])
    cfg, shape, T = _config(record), _shape(record), _seq_len(record)
    if cfg is not None and _exact_formula_fits(record.meta.get("config")):
        out["params_exact"] = count_params(cfg).total
    if shape is not None:
        L, d, V, d_attn = shape
        out["params_12ld2"] = 12 * L * d * d + V * d
        if D and T:
            attn = 12 * L * T * d_attn * D
            out["flops_6nd_attention"] = 6 * N * D + attn
            out["flops_6nd_attention_causal"] = 6 * N * D + attn // 2
    if cfg is not None and D and T:
        layer = korthikanti_layer_bytes(T, D // T, cfg.d_model, cfg.n_heads,
                                        fused_attention=bool(record.meta.get("attention_kernels")))
        out["activation_bytes_korthikanti_16bit"] = cfg.n_layers * layer
    opt = record.optimizer or {}
    if opt.get("kind") in OPTIMIZERS and opt.get("precision") and t.get("trainable_params"):
        sm = static_memory(t["trainable_params"], opt["kind"], opt["precision"])
        out["static_bytes"] = sm.total_bytes
        out["static_bytes_per_param"] = sm.bytes_per_param
    return out


def comparisons(record, p=None) -> list:
    """Rows of measured vs predicted with the gap explained (``p``: ``predictions(record)``,
    when the caller has it already)."""
    t, p = record.totals, p if p is not None else predictions(record)
    rows = []
    cfg = _config(record)
    if "params_exact" in p:
        rows.append(_row("parameters (exact formula)", t["params"], p["params_exact"],
                         "exact count from the config" if t["params"] == p["params_exact"] else
                         "the model has parameters the config formula does not describe"))
    if "params_12ld2" in p:
        rows.append(_row("parameters (12*L*d^2 + V*d)", t["params"], p["params_12ld2"],
                         _explain_12ld2(cfg) if cfg is not None else
                         "L, d and V found from the modules (no config): " + _explain_partial(record)))
    if "flops_6nd" in p:
        f = t["flops"]["total"]
        attn = t["attention_flops"]["dense"]
        other = f - p["flops_6nd"] - attn
        unit = "samples" if counts_samples(t) else "tokens"      # D of an image batch: its samples
        rows.append(_row("training FLOPs vs 6ND", f, p["flops_6nd"],
                         f"N = {t['matmul_params']:,} matmul params (LM head included, lookups not), "
                         f"D = {t['tokens']:,} {unit}; attention adds {_pct(attn, p['flops_6nd'])} of 6ND"
                         + (f"; weights do not all see D {unit} (experts, encoder/decoder lengths, "
                            f"heads on a few rows): 6 x sum(weight x rows it multiplied) = "
                            f"{p['flops_6nd_per_weight']:,}"
                            if _uneven(p) else _other(other, p["flops_6nd"]))))
    if "flops_6nd_attention" in p:
        _, d, _, d_attn = _shape(record)
        rows.append(_row("training FLOPs vs 6ND + 12LTd", t["flops"]["total"], p["flops_6nd_attention"],
                         "attention counted dense; causal-halved prediction "
                         f"{p['flops_6nd_attention_causal']:,}"
                         + (f"; d in 12LTd is heads x head_dim = {d_attn:,}, not the hidden size {d:,}"
                            if d_attn != d else "")))
    if "static_bytes" in p:
        measured = (t["param_bytes"] + t.get("trainable_param_bytes", 0) + t["optimizer_state_bytes"]
                    + (record.optimizer or {}).get("master_weight_bytes", 0))
        opt = record.optimizer
        rows.append(_row("static bytes (params+grads+optimizer)", measured, p["static_bytes"],
                         f"{opt['kind']} x {opt['precision']}: {p['static_bytes_per_param']} bytes/param "
                         f"predicted, {measured / max(t.get('trainable_params', 1), 1):.3f} measured "
                         f"(per-tensor step scalars and frozen params make the difference)"))
    if "activation_bytes_korthikanti_16bit" in p:
        rows.append(_row("activation bytes vs Korthikanti (16-bit)", t["activation_bytes"],
                         p["activation_bytes_korthikanti_16bit"],
                         f"measured in {record.meta.get('dtype')}; the formula assumes 16-bit activations, "
                         f"dropout masks and {'a fused attention kernel' if record.meta.get('attention_kernels') else 'a materialised attention matrix'}; "
                         "embeddings, LM head and loss are outside it"))
    return rows


def check_comparisons(records, options=None) -> list:
    """TL-CMP-001: FLOPs not explained by 6ND + attention; TL-CMP-002: static bytes off prediction."""
    if not records:
        return []
    rec = records[-1]
    tol = float((options or {}).get("tolerance", DEFAULT_TOLERANCE))
    p = predictions(rec)
    out = []
    t = rec.totals
    if "flops_6nd" in p and _shape(rec) is not None and t["flops"]["total"]:
        if _uneven(p):
            explained = p["flops_6nd_per_weight"] + t["attention_flops"]["dense"]
        else:
            explained = p.get("flops_6nd_attention") or p["flops_6nd"] + t["attention_flops"]["dense"]
        gap = (t["flops"]["total"] - explained) / t["flops"]["total"]
        if abs(gap) > tol:
            out.append(Finding("TL-CMP-001", "warning" if _config(rec) is not None else "info",
                               f"{gap:+.1%} of the step's FLOPs are not explained by 6ND + attention",
                               measured=t["flops"]["total"], expected=explained,
                               hint="look for matmuls that belong to no parameter (extra einsums, "
                                    "recomputed projections) in the per-op table"))
    if "static_bytes" in p:
        measured = (t["param_bytes"] + t.get("trainable_param_bytes", 0) + t["optimizer_state_bytes"]
                    + (rec.optimizer or {}).get("master_weight_bytes", 0))
        ratio = measured / p["static_bytes"] if p["static_bytes"] else None
        if ratio is not None and abs(ratio - 1) > tol:
            out.append(Finding("TL-CMP-002", "warning",
                               f"static bytes are {ratio:.3f}x the {rec.optimizer['kind']} x "
                               f"{rec.optimizer['precision']} prediction",
                               measured=measured, expected=p["static_bytes"],
                               hint="extra optimizer state or copies of the weights are being kept"))
    return out


def _row(quantity, measured, predicted, explanation) -> dict:
    return {"quantity": quantity, "measured": measured, "predicted": predicted,
            "ratio": measured / predicted if predicted else None, "explanation": explanation}


def _other(other: int, base: int) -> str:
    if other > 0:
        return f", other matmul work (not parameter-bound) {_pct(other, base)}"
    if other < 0:
        return (f", {_pct(-other, base)} less: gradient matmuls that were not needed (inputs or frozen "
                f"weights that need no grad, e.g. the first layer's input gradient)")
    return ""


def _pct(x, of) -> str:
    return f"{100 * x / of:.1f}%" if of else "n/a"


def _explain_partial(record) -> str:
    cfg = record.meta["config"]
    return (f"L={cfg['n_layers']}, d={cfg['d_model']}, V={cfg['vocab_size']}; the formula assumes a 4d "
            f"GELU MLP, full K/V heads, a tied head and no norms or biases")


def _explain_12ld2(cfg) -> str:
    parts = ["ignores norms and biases"]
    if cfg.n_positions:
        parts.append(f"leaves out the {cfg.n_positions}x{cfg.d_model} position table")
    if cfg.mlp == "swiglu" or cfg.d_ff != 4 * cfg.d_model:
        parts.append(f"assumes a 4d GELU MLP (this one: {cfg.mlp}, d_ff={cfg.d_ff})")
    if cfg.n_kv_heads != cfg.n_heads:
        parts.append(f"assumes full K/V heads (this one: {cfg.n_kv_heads} of {cfg.n_heads})")
    if not cfg.tie_embeddings:
        parts.append("counts one V*d matrix (the untied LM head adds another)")
    return "; ".join(parts)


