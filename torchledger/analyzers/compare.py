"""Measured against closed forms: parameters, FLOPs, static bytes, activations.

Pure functions over a ``StepRecord`` (so they run offline on a saved JSON). Each comparison
row has a ratio (measured / predicted) and a named explanation of the gap. The closed forms
are those of :mod:`.params`, :mod:`.flops`, :mod:`.memory` and :mod:`.activations`.

    rows = comparisons(record)      # [{"quantity", "measured", "predicted", "ratio", "explanation"}]
    findings = check_comparisons([record], {"tolerance": 0.05})
"""
from __future__ import annotations

from ..record import Finding, attention_ran_causal, compute_dtype, counts_samples
from ..formulas.activations import korthikanti_cross_attention_bytes, korthikanti_layer_bytes
from .compare_layout import korthikanti_layer, layout_static, layout_text, sequence_parallel
from .compare_shape import (ATTENTION_FREE, attention_free, enc_dec_lengths as _enc_dec_lengths, seq_len as _seq_len,
                            shape as _shape)
from ..formulas.flops import encoder_decoder_attention_flops
from ..formulas.memory import OPTIMIZERS, bytes_per_param, static_memory
from ..formulas.params import count_params, params_12ld2_encoder_decoder
from ..models.config import TransformerConfig
from .comm import sharding

__all__ = ["predictions", "comparisons", "check_comparisons", "record_predictions"]

DEFAULT_TOLERANCE = 0.05


def _config(record):
    cfg = record.meta.get("config")
    if not cfg or cfg.get("kind") != "transformer" or cfg.get("partial") or attention_free(record):
        return None
    try:
        keys = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "mlp", "norm",
                "bias", "tie_embeddings", "n_positions")
        return TransformerConfig(**{k: cfg[k] for k in keys if k in cfg})
    except (TypeError, ValueError):
        return None


#: Hugging Face model types whose parameters the decoder formula (docs/counting.md)
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


def _frozen_params(t) -> int:
    """Parameters that do not train (requires_grad False); 0 for records made before
    ``trainable_params`` existed."""
    return max(int(t.get("params") or 0) - int(t.get("trainable_params", t.get("params")) or 0), 0)


#: The weights' term of the FLOPs prediction: kind -> row name.
_BASES = {
    "6nd": "training FLOPs vs 6ND",
    "per_weight": "training FLOPs vs 6 x sum(weight x rows)",
    "grads": "training FLOPs vs weights' fwd + grads",
}


def _base_value(p, base: str):
    """The weights' term: 6ND; or each weight x the rows it multiplied, forward plus the
    gradients its backward made (6 x sum(weight x rows) less the input gradients nothing
    needed, e.g. of the pixels; records without the gradient count: 6 x sum(weight x rows))."""
    if base == "6nd":
        return p.get("flops_6nd")
    return p.get("flops_per_weight_grads", p.get("flops_6nd_per_weight"))


def _base(t, p) -> str:
    """Which weights' term describes the step: with frozen weights, the work each weight's
    matmuls really did (forward, plus the gradients its backward made); where weights did not
    all see D tokens (experts, convolutions, encoder/decoder lengths, heads on a few rows),
    6 x sum(weight x rows); else 6ND."""
    if "flops_per_weight_grads" in p and _frozen_params(t):
        return "grads"
    # D counting samples (images): 6 x samples x N is no reference, even where each weight
    # happens to multiply one row per sample
    return "per_weight" if _uneven(p) or (counts_samples(t) and "flops_6nd_per_weight" in p) else "6nd"


def _stage(record):
    """A pipeline stage's record (``parallel.pipeline``): what it holds, or None."""
    cfg = record.meta.get("config")
    if not isinstance(cfg, dict) or not cfg.get("pipeline_stage") or "stage_embedding" not in cfg:
        return None
    return {"embedding": bool(cfg["stage_embedding"]), "head": bool(cfg["stage_head"]),
            "blocks": int(cfg.get("n_layers") or 0), "micro_batches": max(int(cfg.get("stage_micro_batches") or 1), 1),
            "layers_in_flight": float(cfg.get("stage_layers_in_flight") or cfg.get("n_layers") or 0)}


def _stage_text(stage) -> str:
    ends = [e for e, held in (("the embedding", stage["embedding"]), ("the final norm and LM head", stage["head"]))
            if held]
    return (f"pipeline stage: its {stage['blocks']} blocks" + (" and " + " and ".join(ends) if ends else
                                                                " (no embedding, no head)") + "; ")


def _tp(totals) -> int:
    """The tensor-parallel degree a record saw (weights split at their matmuls), 1 without."""
    return max(int(totals.get("tensor_parallel") or 1), 1)


def _cp(totals) -> int:
    """The context-parallel degree of a ``--mesh`` audit whose inputs the standard plan cut to
    T/cp (``totals.context_parallel``), 1 without."""
    return max(int(totals.get("context_parallel") or 1), 1)


def predictions(record) -> dict:
    """Closed-form predictions for what ``record`` measured (keys absent when not computable),
    in this order: the weights' FLOPs, parameters, FLOPs with attention, activations, static
    bytes (the record's JSON keeps it)."""
    t = record.totals
    out = _weight_flops(t)
    cfg, shape, T, D = _config(record), _shape(record), _seq_len(record), t.get("tokens", 0)
    stage = _stage(record)
    if cfg is not None and _exact_formula_fits(record.meta.get("config")):
        count = count_params(cfg)
        out["params_exact"] = count.total
        if stage is not None:       # a pipeline stage: its blocks, and the ends it holds
            b = count.breakdown
            out["params_exact"] -= ((0 if stage["embedding"] else b["embeddings"] + b["positions"])
                                    + (0 if stage["head"] else b["final_norm"] + b["lm_head"]))
    lengths = _enc_dec_lengths(record, shape, D, T)
    if shape is not None and lengths is not None:       # encoder-decoder (T5, BART)
        _predict_enc_dec_flops(out, t, shape, lengths)
    elif shape is not None:
        _predict_decoder_flops(out, t, shape, T, stage)
    if cfg is not None and D and T:
        out.update(_predict_activations(record, cfg, shape, lengths, stage))
    out.update(_predict_static(record))
    return out


def _weight_flops(t) -> dict:
    """The weights' terms: 6ND, 6 x sum(weight x rows), and forward plus the gradients made."""
    out: dict = {}
    N, D = t.get("matmul_params", 0), t.get("tokens", 0)
    if D:
        out["flops_6nd"] = 6 * N * D
    if t.get("param_matmul_flops_forward"):
        # 6 x sum(P_i x rows_i): each weight times the rows it really multiplied. Equal to 6ND
        # when every weight sees every token; not for experts (top-k of E), encoder-decoder
        # stacks (their own lengths) or heads that read a few rows (a classifier's CLS token)
        out["flops_6nd_per_weight"] = 3 * int(t["param_matmul_flops_forward"])
        if t.get("param_matmul_flops_grad") is not None:
            # forward 2 x sum(P x rows) + one forward per gradient made: frozen weights make no
            # weight gradient, inputs that need none (pixels, a frozen stem's output) no input
            # gradient; 6 x sum(P x rows) when everything trains
            out["flops_per_weight_grads"] = int(t["param_matmul_flops_forward"]) + int(t["param_matmul_flops_grad"])
    return out


def _predict_enc_dec_flops(out: dict, t, shape, lengths) -> None:
    """An encoder-decoder's (T5, BART) 12Ld^2 and FLOPs with attention, into ``out``."""
    N, D = t.get("matmul_params", 0), t.get("tokens", 0)
    L, d, V, d_attn, n_enc, n_dec = shape[:6]
    out["params_12ld2"] = params_12ld2_encoder_decoder(d, n_enc, n_dec, V)
    args = (n_enc, n_dec, lengths.t_enc, lengths.t_dec, d_attn, lengths.d_enc, lengths.d_dec)
    # decoder tokens != encoder tokens: 6ND is not the weights' work; 6 x sum(weight x
    # rows) is (each stack's weights at its own tokens, cross K/V at the encoder's)
    kind = _base(t, out)
    if kind == "6nd" and lengths.d_dec != lengths.d_enc and "flops_6nd_per_weight" in out:
        kind = "per_weight"
    base = _base_value(out, kind) if kind != "6nd" else 6 * N * D
    out["flops_6nd_attention"] = base + encoder_decoder_attention_flops(*args)
    out["flops_6nd_attention_causal"] = base + encoder_decoder_attention_flops(*args, causal=True)


def _predict_decoder_flops(out: dict, t, shape, T, stage) -> None:
    """A decoder's (or encoder's) 12Ld^2 + Vd and FLOPs with attention, into ``out``."""
    D = t.get("tokens", 0)
    L, d, V, d_attn = shape[:4]
    out["params_12ld2"] = (params_12ld2_encoder_decoder(d, shape.n_enc, shape.n_dec, V)
                           if shape.n_enc is not None else 12 * L * d * d + V * d)
    if D and T:
        # per token and layer: Q K^T 2*T*d_qk + x V 2*T*d_v forward, 3x for training;
        # tensor parallelism splits the heads over its ranks (Megatron's plan); under
        # context parallelism a rank's T/cp queries (its D tokens) attend all T = cp x T/cp keys
        attn = 6 * L * T * _cp(t) * (shape.attn_width or 2 * d_attn) * D // _tp(t)
        base = _base_value(out, _base(t, out))
        out["flops_6nd_attention"] = base + attn
        out["flops_6nd_attention_causal"] = base + attn // 2
    if stage is not None and shape.n_enc is None:   # one V*d if the stage holds an end
        out["params_12ld2"] = 12 * L * d * d + (V * d if stage["embedding"] or stage["head"] else 0)


def _predict_activations(record, cfg, shape, lengths, stage) -> dict:
    """Korthikanti's activation bytes (16-bit) for the step's layers; with tensor parallelism,
    which of Table 2's rows applies."""
    t, T = record.totals, _seq_len(record)
    D = t.get("tokens", 0)
    out: dict = {}
    fused = _attention_storage(record)[0]
    if lengths is not None:
        b = D // T
        enc = korthikanti_layer_bytes(lengths.t_enc, b, cfg.d_model, cfg.n_heads, fused_attention=fused)
        dec = (korthikanti_layer_bytes(lengths.t_dec, b, cfg.d_model, cfg.n_heads, fused_attention=fused)
               + korthikanti_cross_attention_bytes(lengths.t_dec, lengths.t_enc, b, cfg.d_model,
                                                   cfg.n_heads, fused_attention=fused))
        out["activation_bytes_korthikanti_16bit"] = shape.n_enc * enc + shape.n_dec * dec
        return out
    tp, sp = _tp(t), sequence_parallel(record)
    if stage is not None:   # one micro-batch's layers, as many as the schedule keeps
        layer = korthikanti_layer(T, D // T // stage["micro_batches"], cfg.d_model, cfg.n_heads,
                                  tp=tp, sp=sp, fused=fused)
        out["activation_bytes_korthikanti_16bit"] = round(stage["layers_in_flight"] * layer)
    else:
        layer = korthikanti_layer(T, D // T, cfg.d_model, cfg.n_heads, tp=tp, sp=sp, fused=fused)
        out["activation_bytes_korthikanti_16bit"] = round(cfg.n_layers * layer)
    if tp > 1:
        out["activation_korthikanti_row"] = ("tp+sp (PyTorch)" if sp else "tp", tp)
    return out


def _predict_static(record) -> dict:
    """Parameters + gradients + optimizer state (+ master weights) this rank holds, where the
    optimizer and its precision are known."""
    t, out = record.totals, {}
    opt = record.optimizer or {}
    if not (opt.get("kind") in OPTIMIZERS and opt.get("precision") and t.get("trainable_params")):
        return out
    # trainable: params + grads + master + optimizer state; frozen: their weights only
    gpus, zero = sharding(record)               # (1, 0) unless a distributed rank holds shards
    sm = static_memory(t["trainable_params"], opt["kind"], opt["precision"], gpus=gpus, zero=zero)
    frozen = _frozen_params(t) * bytes_per_param(opt["kind"], opt["precision"])["params"]
    layout = t.get("layout") or {}
    if layout.get("params") and (gpus > 1 or _tp(t) > 1 or layout.get("tp", 1) > 1 or int(opt.get("shards") or 1) > 1):
        # the mesh as PyTorch laid it out: each parameter's shard on this rank (TP's split,
        # then FSDP2's padded dim 0), x bytes per parameter; replicate groups divide nothing
        out["static_bytes"], out["static_bytes_layout"] = layout_static(layout, opt)
    elif zero and _tp(t) > 1:
        # FSDP x TP: a tensor-parallel weight is split over every rank, a replicated one
        # (norms, embeddings, the head in most plans) over the data-parallel ranks only:
        # this rank's share lies between the two
        dp = max(gpus // _tp(t), 1)
        out["static_bytes"] = round(sm.per_gpu_bytes + frozen / gpus)
        out["static_bytes_upper"] = round(sm.total_bytes / dp + frozen / dp)
        out["static_bytes_zero"] = [gpus, zero]
        out["static_bytes_tp"] = [dp, _tp(t)]
    elif zero:                                  # ZeRO-3: this rank's share of everything
        out["static_bytes"] = round(sm.per_gpu_bytes + frozen / gpus)
        out["static_bytes_zero"] = [gpus, zero]
    else:
        out["static_bytes"] = sm.total_bytes + frozen
    out["static_bytes_per_param"] = sm.bytes_per_param
    if frozen:
        out["static_bytes_frozen"] = frozen
    return out


def comparisons(record, p=None) -> list:
    """Rows of measured vs predicted with the gap explained (``p``: ``predictions(record)``,
    when the caller has it already): parameters, FLOPs, static bytes, activations."""
    t, p = record.totals, p if p is not None else predictions(record)
    cfg, shape = _config(record), _shape(record)
    lengths = _enc_dec_lengths(record, shape, t.get("tokens", 0), _seq_len(record))
    rows = _param_rows(record, p, cfg, shape)
    base = _base(t, p)
    if base == "6nd" and "flops_6nd" in p:
        f = t["flops"]["total"]
        attn = t["attention_flops"]["dense"]
        other = f - p["flops_6nd"] - attn
        rows.append(_row("training FLOPs vs 6ND", f, p["flops_6nd"],
                         f"N = {t['matmul_params']:,} matmul params (LM head included, lookups not), "
                         f"D = {t['tokens']:,} {_unit(t)}; "
                         + (_mixer_text(record) if attention_free(record) else
                            f"attention adds {_pct(attn, p['flops_6nd'])} of 6ND")
                         + _other(other, p["flops_6nd"], record)))
    elif base != "6nd":
        rows.append(_weights_row(record, p, base))
    if "flops_6nd_attention" in p:
        rows.append(_attention_flops_row(record, p, base, shape, lengths))
    if "static_bytes" in p:
        rows.append(_static_row(record, p))
    if "activation_bytes_korthikanti_16bit" in p:
        rows.append(_activation_row(record, p, cfg, shape, lengths))
    return rows


def _param_rows(record, p, cfg, shape) -> list:
    """Parameters against the exact formula and against 12Ld^2 + Vd, where predicted."""
    t, rows = record.totals, []
    stage = _stage(record)
    if "params_exact" in p:
        rows.append(_row("parameters (exact formula)", t["params"], p["params_exact"],
                         (_stage_text(stage) if stage is not None else "")
                         + ("exact count from the config" if t["params"] == p["params_exact"] else
                            "the model has parameters the config formula does not describe")))
    if "params_12ld2" in p:
        enc_dec = ""
        if shape is not None and shape.n_enc is not None:
            enc_dec = (f"L = {shape.n_enc} encoder + {shape.n_dec} decoder layers; cross-attention "
                       f"counted: 12d^2 per encoder layer, 16d^2 per decoder layer (self 4d^2 + "
                       f"cross 4d^2 + MLP 8d^2), 12*{shape.n_enc}*d^2 + 16*{shape.n_dec}*d^2 + V*d; ")
        rows.append(_row("parameters (12*L*d^2 + V*d)", t["params"], p["params_12ld2"],
                         (_stage_text(stage) if stage is not None else "") + enc_dec + (_explain_12ld2(cfg, record.meta.get("config")) if cfg is not None else
                                    "L, d and V found from the modules (no config): " + _explain_partial(record))))
    return rows


def _attention_flops_row(record, p, base: str, shape, lengths) -> dict:
    """Training FLOPs against 6ND + 12LTd (the weights' term ``base``), the attention term
    explained: encoder-decoder lengths, or tensor and context parallelism."""
    t = record.totals
    if lengths is not None:
        text = (f"L = {shape.n_enc} encoder + {shape.n_dec} decoder layers; attention counted dense: "
                f"encoder self 12*L_enc*T_enc*d*D_enc + decoder self 12*L_dec*T_dec*d*D_dec + "
                f"cross 12*L_dec*T_enc*d*D_dec, {lengths.how}; causal prediction {p['flops_6nd_attention_causal']:,} halves "
                f"the decoder self-attention only")
        if lengths.d_dec != lengths.d_enc and "flops_6nd_per_weight" in p and base != "grads":
            text += (f"; the weights' term is 6 x sum(weight x rows it multiplied) = "
                     f"{_base_value(p, 'per_weight'):,}, not 6ND: the decoder's weights saw "
                     f"{lengths.d_dec:,} tokens, the encoder's {lengths.d_enc:,}")
        elif lengths.d_dec != lengths.d_enc and base != "grads":
            text += (f"; 6ND takes every weight at D = {t['tokens']:,} tokens, the encoder's "
                     f"saw {lengths.d_enc:,} rows, the decoder's {lengths.d_dec:,}")
    else:
        text = _dense_attention_text(record, p)
        if _tp(t) > 1:
            text += (f"; tensor parallel {_tp(t)}: N is this rank's part of the split weights, "
                     f"the attention term its share of the heads (1/{_tp(t)})")
        if _cp(t) > 1:
            T = _seq_len(record)
            text += (f"; context parallel {_cp(t)}: this rank's {T:,} queries a sequence attend all "
                     f"T = {_cp(t)} x {T:,} = {_cp(t) * T:,} keys (K and V all-gathered)")
    if base != "6nd" and lengths is None:
        text += f"; the weights' term is {_BASES[base].split(' vs ')[1]} = {_base_value(p, base):,}, not 6ND"
    elif base == "grads":
        text += f"; the weights' term is their forward + the gradients made = {_base_value(p, base):,} (frozen weights)"
    return _row("training FLOPs vs 6ND + 12LTd", t["flops"]["total"], p["flops_6nd_attention"],
                text + _width_text(record, shape))


def _static_row(record, p) -> dict:
    """Parameters + gradients + optimizer state measured against the closed form, with the
    sharding that divided it."""
    t, opt = record.totals, record.optimizer
    measured = (t["param_bytes"] + t.get("trainable_param_bytes", 0) + t["optimizer_state_bytes"]
                + (record.optimizer or {}).get("master_weight_bytes", 0))
    frozen = (f" + {p['static_bytes_frozen']:,} bytes of {_frozen_params(t):,} frozen params "
              f"(their weights only: no gradient, no optimizer state)" if p.get("static_bytes_frozen") else "")
    whole = (f"trainable param x {t['trainable_params']:,}{frozen} predicted" if not p.get("static_bytes_layout")
             else f"trainable param (a frozen one: its weight only), of the {t['trainable_params']:,} "
                  f"trainable params")
    return _row("static bytes (params+grads+optimizer)", measured, p["static_bytes"],
                f"{opt['kind']} x {opt['precision']}: {p['static_bytes_per_param']} bytes per "
                + whole
                + (layout_text(p["static_bytes_layout"]) if p.get("static_bytes_layout") else "")
                + (" / {} ranks (ZeRO-3: this rank's shards; padding to a multiple of {} "
                   "rows makes rank 0's larger)".format(p["static_bytes_zero"][0], p["static_bytes_zero"][0])
                   if p.get("static_bytes_zero") and not p.get("static_bytes_tp") else "")
                + (" / {} ranks if every weight were split both ways; up to {:,} (/ {} data-parallel "
                   "ranks) for weights tensor parallelism ({}) leaves whole (norms, embeddings, "
                   "head)".format(p["static_bytes_zero"][0], p["static_bytes_upper"],
                                  p["static_bytes_tp"][0], p["static_bytes_tp"][1])
                   if p.get("static_bytes_tp") else "")
                + " (per-tensor step scalars make the difference)")


def _activation_row(record, p, cfg, shape, lengths) -> dict:
    """Activation bytes against Korthikanti's 16-bit closed form, with which of its rows and
    which layers (encoder-decoder, pipeline stage, tensor parallelism) it describes."""
    t, layers = record.totals, ""
    if lengths is not None:
        layers = (f"L = {shape.n_enc} encoder layers at s = {lengths.t_enc:,} + {shape.n_dec} decoder "
                  f"layers at s = {lengths.t_dec:,}, each decoder layer with its cross-attention "
                  f"block (9*s_d*b*h + 4*s_e*b*h + 5*a*s_d*s_e*b; {lengths.how}); ")
    kind = p.get("activation_korthikanti_row")
    stage = _stage(record)
    if stage is not None and lengths is None:
        layers += (f"pipeline stage: one micro-batch ({t.get('tokens', 0) // stage['micro_batches']:,} tokens) "
                   f"x {stage['layers_in_flight']:g} layers, its {stage['blocks']} blocks and the schedule's "
                   f"extra in-flight micro-batches of a chunk's blocks; ")
    if kind and kind[0] == "tp":
        layers += (f"tensor parallel {kind[1]}: Table 2's TP row sbh(10 + 24/t + 5as/(ht)) (LayerNorm and "
                   f"block inputs and dropout masks, 10sbh, stay whole on every rank); ")
    elif kind:
        layers += (f"tensor + sequence parallel {kind[1]}: what PyTorch saves, Table 2's TP+SP row "
                   f"sbh(34/t + 5as/(ht)) plus the all-gathered inputs of attention and MLP that its "
                   f"column-parallel linears keep, 2 x 2sbh(1 - 1/t) (Megatron keeps the shard and "
                   f"re-gathers in backward); ")
    block = _korthikanti_block(cfg) if cfg is not None else ""
    return _row("activation bytes vs Korthikanti (16-bit)", t["activation_bytes"],
                p["activation_bytes_korthikanti_16bit"],
                layers + f"{_measured_dtype(record)}; the formula assumes 16-bit "
                f"activations and dropout masks; {block}{_attention_storage(record)[1]}; "
                "embeddings, LM head and loss are outside it")


def _dense_attention_text(record, p) -> str:
    """The 12LTd row's convention: counted dense, and the causal-halved prediction where the
    step's attention ran causal (a decoder); where it ran and none was causal (an encoder, a
    UNet's cross-attention) the halved figure is no reference and the row says so."""
    if attention_ran_causal(record) is False:
        return "attention counted dense, as it ran (no kernel ran causal: no causal-halved prediction applies)"
    return f"attention counted dense; causal-halved prediction {p['flops_6nd_attention_causal']:,}"


def _measured_dtype(record) -> str:
    """What the activation row was measured in: the compute dtype as the matmuls ran
    (:func:`compute_dtype`), with autocast's or the precision plan's part named, not the
    weights' dtype alone (float32 under ``--precision bf16-mixed``)."""
    weights = str(record.meta.get("dtype") or "?")
    compute, how = compute_dtype(record)
    if compute == weights or how in ("weights", "matmuls"):
        return f"measured in {compute}"
    return f"measured in {compute} compute under {how} ({weights} weights)"


def record_predictions(record) -> dict:
    """``record.predictions`` as a finished record stores it: :func:`predictions` with
    the record format's keys (docs/record-format.md) always present and the :func:`comparisons` rows. A prediction never costs
    the user the measurement: an error becomes a line in ``record.warnings``."""
    try:
        p = predictions(record)
        rows = comparisons(record, p)
    except Exception as e:  # noqa: BLE001
        record.warnings.append(f"predictions unavailable: {type(e).__name__}: {e}")
        p, rows = {}, []
    out = {"params_12ld2": None, "flops_6nd": None, "flops_6nd_attention": None, "static_bytes": None}
    out.update(p)
    out["comparisons"] = rows
    return out


def check_comparisons(records, options=None) -> list:
    """TL-CMP-001: FLOPs not explained by 6ND + attention; TL-CMP-002: static bytes off prediction."""
    if not records:
        return []
    rec = records[-1]
    tol = float((options or {}).get("tolerance", DEFAULT_TOLERANCE))
    p = predictions(rec)
    out = []
    t = rec.totals
    base = _base(t, p)
    name, weights = _BASES[base], _base_value(p, base)
    # an attention-free model (no shape): no closed form for its scan, nothing to judge it by
    if weights is not None and _shape(rec) is not None and t["flops"]["total"]:
        if "flops_6nd_attention" in p:
            explained, what = p["flops_6nd_attention"], name.split(" vs ")[1] + " + 12LTd attention"
        else:
            explained = weights + t["attention_flops"]["dense"]
            what = name.split(" vs ")[1] + " + attention as measured"
        measured = t["flops"]["total"]
        gap = (measured - explained) / explained if explained else 0.0
        if abs(gap) > tol:     # gap = (measured - predicted) / predicted: > 0 above, < 0 below
            out.append(Finding("TL-CMP-001", "warning" if _config(rec) is not None else "info",
                               f"the step's FLOPs ({measured:,}) are {abs(gap):.1%} "
                               f"{'above' if gap > 0 else 'below'} {what} ({explained:,})",
                               measured=measured, expected=explained,
                               hint="above: look for matmuls that belong to no parameter (extra "
                                    "einsums, recomputed projections) in the per-op table; below: "
                                    "gradients that were not made, or weights the prediction "
                                    "counts that did not multiply"))
    if "static_bytes" in p:
        measured = (t["param_bytes"] + t.get("trainable_param_bytes", 0) + t["optimizer_state_bytes"]
                    + (rec.optimizer or {}).get("master_weight_bytes", 0))
        ratio = measured / p["static_bytes"] if p["static_bytes"] else None
        upper = p.get("static_bytes_upper")
        if ratio is not None and upper and 1 - tol <= ratio and measured <= upper * (1 + tol):
            ratio = None                            # FSDP x TP: within the range its plan allows
        if ratio is not None and abs(ratio - 1) > tol:
            out.append(Finding("TL-CMP-002", "warning",
                               f"static bytes ({measured:,}) are {ratio:.3f}x, {abs(ratio - 1):.1%} "
                               f"{'above' if ratio > 1 else 'below'}, the {rec.optimizer['kind']} x "
                               f"{rec.optimizer['precision']} prediction ({p['static_bytes']:,})",
                               measured=measured, expected=p["static_bytes"],
                               hint="extra optimizer state or copies of the weights are being kept"))
    return out


#: Substrings of the attention kernels that keep no s x s score matrix, as the record names
#: them: tracer/build.py ATTENTION_KERNELS labels ("CPU flash attention", "CUDA flash
#: attention", "memory-efficient attention", "cuDNN attention") or the raw aten name of one it
#: does not list (_scaled_dot_product_fused_attention_overrideable).
_FUSED_MARKERS = ("flash", "efficient", "cudnn", "fused")


def _attention_storage(record) -> tuple:
    """(fused, text): whether the step's attention kept no s x s scores, so Korthikanti's
    5as^2b term is dropped. Only when a fused kernel ran and no math-path attention did: the
    SDPA math path ("SDPA math path (bmm + softmax)", aten _scaled_dot_product_attention_math)
    stores the softmax output and its dropout mask like eager attention does."""
    kernels = [str(k) for k in record.meta.get("attention_kernels") or []]
    math = [k for k in kernels if "math" in k.lower()]
    fused = [k for k in kernels if k not in math and any(m in k.lower() for m in _FUSED_MARKERS)]
    if fused and not math:
        return True, (f"assumed a fused attention kernel ({', '.join(fused)} ran, no math path): "
                      f"no s x s scores kept, the 5as^2b term dropped")
    if math:
        return False, (f"assumed a materialised attention matrix ({', '.join(math)} ran"
                       + (f", besides {', '.join(fused)}" if fused else "")
                       + "): the 5as^2b term kept")
    if kernels:
        return False, (f"assumed a materialised attention matrix ({', '.join(kernels)}: not a known "
                       f"fused kernel): the 5as^2b term kept")
    return False, ("assumed a materialised attention matrix (no SDPA kernel seen: eager attention "
                   "or none): the 5as^2b term kept")


def _width_text(record, shape) -> str:
    """What d in 12LTd is, when it is not the hidden size."""
    cfg = record.meta.get("config") or {}
    if shape.attn_width:
        return (f"; multi-head latent attention: Q K^T at heads x (qk_nope + qk_rope head dims) = "
                f"{cfg['d_attn_qk']:,}, x V at heads x v_head_dim = {cfg['d_attn_v']:,}: "
                f"6LT x ({cfg['d_attn_qk']:,} + {cfg['d_attn_v']:,}) per token, not 12LTd (d = {shape.d:,})")
    if shape.d_attn != shape.d:
        return f"; d in 12LTd is heads x head_dim = {shape.d_attn:,}, not the hidden size {shape.d:,}"
    return ""


def _unit(t) -> str:
    return "samples" if counts_samples(t) else "tokens"      # D of an image batch: its samples


def _weights_row(record, p, base) -> dict:
    """The FLOPs row when 6ND does not describe the weights' work (see ``_base``)."""
    t = record.totals
    name, ref = _BASES[base], _base_value(p, base)
    f, attn = t["flops"]["total"], t["attention_flops"]["dense"]
    six = (f"6ND = {p['flops_6nd']:,} (N = {t['matmul_params']:,} matmul params, D = "
           f"{t['tokens']:,} {_unit(t)})" if "flops_6nd" in p and not counts_samples(t) else "")
    if base == "grads":
        text = (f"{_frozen_params(t):,} of {t['params']:,} params are frozen: a frozen weight's "
                f"matmul costs its forward (2 x weight x rows), plus 2 x that when its input needs "
                f"grad, never a weight gradient; a trainable one 6 x weight x rows, 4 when its input "
                f"needs none" + (f"; {six} would count every weight as trained" if six else ""))
    else:
        skipped = p["flops_6nd_per_weight"] - ref
        why = ("no D (tokens) given" if "flops_6nd" not in p else
               f"D = {t['tokens']:,} counts samples, not tokens: 6ND is no reference" if counts_samples(t)
               else f"weights do not all see D {_unit(t)} (convolutions at every output position, "
                    f"experts, encoder/decoder lengths, heads on a few rows)")
        text = (f"{why}: each weight x the rows "
                f"it multiplied, 6 x sum(weight x rows) = {p['flops_6nd_per_weight']:,}"
                + (f" less {skipped:,} of input gradients nothing needed (the first layer's, of "
                   f"inputs without grad)" if skipped > 0 else "") + (f"; {six}" if six else ""))
    if attention_free(record):
        text += "; " + _mixer_text(record)
    if "flops_6nd_attention" in p or not attn:   # the 12LTd row predicts attention; none here
        return _row(name, f, ref, text + (f"; attention adds {_pct(attn, ref)}" if attn else "")
                    + _other(f - ref - attn, ref, record))
    # no closed form for attention here (no config, or D counts samples): as measured
    return _row(name + " + attention", f, ref + attn, text + f"; attention as measured, {attn:,}"
                + _other(f - ref - attn, ref))


def _row(quantity, measured, predicted, explanation) -> dict:
    return {"quantity": quantity, "measured": measured, "predicted": predicted,
            "ratio": measured / predicted if predicted else None, "explanation": explanation}


def _mixer_text(record) -> str:
    return f"a {attention_free(record)} model, {ATTENTION_FREE}"


def _other(other: int, base: int, record=None) -> str:
    if other > 0 and record is not None and attention_free(record):
        return f"; the scan's matmul work (not parameter-bound) {_pct(other, base)}"
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


def _experts_text(cfg, meta_cfg):
    """(text, main): what a mixture of experts adds to the parameters beyond the formula's one
    MLP per layer, and whether that is the largest of the gaps the formula leaves (None, False
    for a dense model). The other gaps, in parameters: the untied head V*d, the position table,
    the MLP's own shape (one expert, or the dense MLP, against 8d^2) and K/V heads."""
    meta_cfg = meta_cfg or {}
    E, experts, layers = (meta_cfg.get(k) for k in ("n_experts", "expert_params", "moe_layers"))
    if not (isinstance(E, int) and E > 1 and experts and layers):
        return None, False
    d, L = cfg.d_model, cfg.n_layers
    extra = experts * (E - 1) // E                      # every expert but one per MoE layer
    one = 3 * d * cfg.d_ff if cfg.gated else 2 * d * cfg.d_ff
    d_attn = int(meta_cfg.get("d_attn") or d)
    head = d_attn // cfg.n_heads if cfg.n_heads else 0
    others = [0 if cfg.tie_embeddings else cfg.vocab_size * d, cfg.n_positions * d,
              experts // E + (L - layers) * one - 8 * L * d * d,
              L * (2 * d * d_attn + 2 * d * cfg.n_kv_heads * head - 4 * d * d)]
    text = (f"{E} experts in each of {layers} layers hold {experts:,} params where the formula counts "
            f"one 4d MLP per layer: every expert but one adds {extra:,}")
    return text, extra >= max(abs(x) for x in others)


def _korthikanti_block(cfg) -> str:
    """What of Korthikanti's GPT layer (a 4d GELU MLP, full K/V heads, LayerNorm; 34sbh +
    5as^2b) this model's block does otherwise, for the activation row's note ("" when
    nothing): the tensors its MLP, attention and norms keep for backward differ in number
    and width, so the row's ratio is not the tracer's error alone."""
    parts = []
    if cfg.mlp != "gelu" or cfg.d_ff != 4 * cfg.d_model:
        parts.append(f"its MLP is GELU's at 4d (this one: {cfg.mlp}, d_ff = {cfg.d_ff / cfg.d_model:.3g}d)")
    if cfg.n_kv_heads != cfg.n_heads:
        parts.append(f"its K/V heads are all {cfg.n_heads} (this one: {cfg.n_kv_heads})")
    if cfg.norm != "layernorm":
        parts.append(f"its norms LayerNorms (this one: {cfg.norm})")
    return "Korthikanti's layer is GPT's: " + ", ".join(parts) + "; " if parts else ""


def _explain_12ld2(cfg, meta_cfg=None) -> str:
    experts, main = _experts_text(cfg, meta_cfg)
    parts = [f"main cause: {experts}"] if main else []
    parts.append("ignores norms and biases")
    if cfg.n_positions:
        parts.append(f"leaves out the {cfg.n_positions}x{cfg.d_model} position table")
    if cfg.mlp != "gelu" or cfg.d_ff != 4 * cfg.d_model:
        parts.append(f"assumes a 4d GELU MLP (this one: {cfg.mlp}, d_ff={cfg.d_ff})")
    if cfg.n_kv_heads != cfg.n_heads:
        parts.append(f"assumes full K/V heads (this one: {cfg.n_kv_heads} of {cfg.n_heads})")
    if not cfg.tie_embeddings:
        parts.append("counts one V*d matrix (the untied LM head adds another)")
    if experts and not main:
        parts.append(experts)
    return "; ".join(parts)


