"""``torchledger estimate``: closed-form napkin math, no torch imported.

Each subcommand parses its numbers (``7B``, ``15T``, ``80GB``), calls one analyzer from
:mod:`torchledger.formulas` and prints either a table for people (numbers, formula,
assumptions) or, with ``--json``, one JSON object on stdout and nothing else.

``--preset NAME`` fills in what a named reference model knows (exact N, layers, heads...).
Explicit flags override the preset (``--preset llama2-7b --layers 2``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict

import click

from .. import formulas as an
from ..formulas.flops import exact
from ..formulas.hardware import DTYPES
from ..formulas.inference import DTYPE_BYTES, KV_DTYPES
from ..formulas.memory import WEIGHT_DTYPES
from ..models.config import MLP_KINDS, NORM_KINDS, TransformerConfig, get_config
from ..units import GiB, fmt_bytes, fmt_count, fmt_flops, fmt_int
from .types import BYTES, COUNT, FLOPS, FRACTION, POS_FLOAT, POS_INT, InputError, PlainNumber, echo_out, gpu_part

__all__ = ["estimate"]

SCHEMA = "torchledger.estimate/1"
DEFAULT_GPU = "H100 SXM"
DEFAULT_MFU = 0.4
CONVENTIONS = ["FLOP = 2 x multiply-add", "GB = 1e9 bytes, GiB = 2^30 bytes"]

# TransformerConfig field -> the flag a user typed, for its ValueError messages.
_FLAG_OF = {"vocab_size": "--vocab", "d_model": "--hidden", "n_layers": "--layers",
            "n_kv_heads": "--kv-heads", "n_heads": "--heads", "d_ff": "--ffn",
            "n_positions": "--positions", "mlp": "--mlp", "norm": "--norm",
            "bias": "--bias", "tie_embeddings": "--tie-embeddings"}



def _preset(ctx, param, value):
    if value is None:
        return None
    try:
        return get_config(value)
    except KeyError as e:
        raise click.BadParameter(str(e.args[0]), ctx, param) from None


def _gpu(ctx, param, value):
    if value is None:
        return None
    return gpu_part(value, ctx=ctx, param=param)


def _flagify(message: str) -> str:
    for fld, flag in _FLAG_OF.items():
        message = re.sub(rf"\b{fld}\b", flag, message)
    return message


def _transformer(cfg, what: str) -> TransformerConfig:
    if not isinstance(cfg, TransformerConfig):
        raise InputError(f"--preset {cfg.name} is not a Transformer, so {what} does not "
                         f"apply; choose a Transformer preset such as gpt2 or llama3-8b")
    return cfg


def _n_params(params, preset, *, matmul: bool):
    """--params wins over --preset; from a preset, its exact total (or matmul) count."""
    if params is not None:
        return params
    if preset is None:
        raise click.UsageError("give --params N (e.g. 7B), or --preset NAME")
    count = an.count_params(preset)
    return count.matmul if matmul else count.total


def _peak(gpu, dtype: str, peak_flops, hint: str):
    if peak_flops is not None:
        return peak_flops
    try:
        return gpu.peak(dtype)
    except ValueError as e:
        raise InputError(f"--dtype {dtype}: {e}; {hint}") from None


def _emit(data: dict, as_json: bool, title: str, rows: list, notes: list) -> None:
    """One JSON object, or a table of (quantity, value, formula) rows plus notes."""
    if as_json:
        echo_out(json.dumps({"schema": SCHEMA, **data}))
        return
    from tabulate import tabulate

    table = tabulate(rows, headers=["quantity", "value", "formula"], disable_numparse=True)
    echo_out("\n".join([title, table, "\nAssumptions:", *(f"  - {note}" for note in notes + CONVENTIONS)]))


def _whole(data: dict, *keys) -> dict:
    """``data`` with the count-valued ``keys`` as ints (rounded), so that a JSON key has one
    type whatever was typed: 6ND of ``--params 7.5`` is ``45000000000``, not ``4.5e10``."""
    for k in keys:
        v = data.get(k)
        if isinstance(v, float) and math.isfinite(v):
            data[k] = int(round(v))
    return data


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON object on stdout and nothing else.")(f)


def _preset_option(f):
    return click.option("--preset", callback=_preset, metavar="NAME",
                        help="A reference model (gpt2, llama2-7b, llama3-8b, ...).")(f)


@click.group()
def estimate():
    """Closed-form estimates: params, train, memory, kv-cache, decode."""



def _config_from_flags(preset, flags: dict) -> object:
    given = {k: v for k, v in flags.items() if v is not None}
    if preset is not None:
        if given:
            _transformer(preset, ", ".join(_FLAG_OF[k] for k in given))
        return _replace(preset, given)
    missing = [_FLAG_OF[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads")
               if k not in given]
    if missing:
        raise click.UsageError(f"give --preset NAME, or all of --vocab, --hidden, --layers and "
                               f"--heads (missing: {', '.join(missing)})")
    return _replace(None, given)


def _replace(base, given: dict):
    try:
        return base.replace(**given) if base is not None else TransformerConfig(**given)
    except ValueError as e:
        raise InputError(_flagify(str(e))) from None


def _component_formulas(cfg) -> dict:
    if not isinstance(cfg, TransformerConfig):
        return {"layers": "num_layers * dim^2", "final": "dim"}
    b = " + biases" if cfg.bias else ""
    mats = 3 if cfg.gated else 2
    norm = "d" if cfg.norm == "rmsnorm" else ("2d" if cfg.bias else "d")
    return {"embeddings": "V*d", "positions": "n_positions*d",
            "attention": f"L*(2*d^2 + 2*d*h_kv*d_h{b})", "mlp": f"L*({mats}*d*d_ff{b})",
            "norms": f"L*2*{norm} ({cfg.norm})", "final_norm": norm,
            "lm_head": "0 (tied)" if cfg.tie_embeddings else "V*d"}


@estimate.command("params")
@_preset_option
@click.option("--vocab", type=POS_INT, help="Vocabulary size V.")
@click.option("--hidden", type=POS_INT, help="Hidden size d.")
@click.option("--layers", type=POS_INT, help="Number of blocks L.")
@click.option("--heads", type=POS_INT, help="Query heads h (d must divide by h).")
@click.option("--kv-heads", type=POS_INT, help="Key/value heads (GQA); default --heads.")
@click.option("--ffn", type=POS_INT, help="MLP width; default 4d (gelu) or Llama's 8d/3 rule.")
@click.option("--mlp", type=click.Choice(MLP_KINDS), help="MLP kind (default gelu).")
@click.option("--norm", type=click.Choice(NORM_KINDS), help="Norm kind (default layernorm).")
@click.option("--bias/--no-bias", default=None, help="Biases on projections and LayerNorm.")
@click.option("--tie-embeddings/--no-tie-embeddings", default=None,
              help="LM head shares the embedding (default tied).")
@click.option("--positions", type=PlainNumber(0, example="2048"),
              help="Rows of a learned position table (0: RoPE, the default).")
@_json_option
def params_cmd(preset, vocab, hidden, layers, heads, kv_heads, ffn, mlp, norm, bias,
               tie_embeddings, positions, as_json):
    """Exact parameter count, per component, and the 12*L*d^2 + V*d approximation.

    Give --preset NAME, or --vocab, --hidden, --layers and --heads. With both, the flags
    override the preset's values.
    """
    cfg = _config_from_flags(preset, {
        "vocab_size": vocab, "d_model": hidden, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": kv_heads, "d_ff": ffn, "mlp": mlp, "norm": norm, "bias": bias,
        "tie_embeddings": tie_embeddings, "n_positions": positions})
    count = an.count_params(cfg)
    notes = ["matmul N (for 6ND) = every Linear weight, incl. the LM head even when tied; "
             "embedding/position lookups, norms and biases excluded"]
    if isinstance(cfg, TransformerConfig) and cfg.tie_embeddings:
        notes.insert(0, "a tied LM head shares the embedding's weight: counted once "
                        "(lm_head 0)")
    data = {**count.to_dict(), "config": asdict(cfg), "assumptions": notes}
    formulas = _component_formulas(cfg)
    rows = [[k, f"{fmt_int(v)} ({100 * count.shares()[k]:.1f}%)", formulas.get(k, "")]
            for k, v in count.breakdown.items()]
    rows += [["total", fmt_int(count.total), "sum of the components"],
             ["matmul N", fmt_int(count.matmul), "Linear weights incl. LM head"]]
    if count.approx_12ld2 is not None:
        rows += [["12*L*d^2 + V*d", fmt_int(count.approx_12ld2),
                  f"{100 * count.approx_rel_error:+.1f}% vs exact"],
                 ["12*L*d^2", fmt_int(count.blocks_12ld2), "blocks only"]]
    _emit(data, as_json, f"Parameters of {cfg.name or 'the given config'}", rows, notes)



def _attention_terms(preset, seq_len, tokens) -> dict:
    if preset is None:
        if seq_len is not None:
            raise click.UsageError("--seq-len needs --preset NAME (for the layers and width "
                                   "of the attention term)")
        return {}
    if not isinstance(preset, TransformerConfig):
        return {}
    T = seq_len or preset.max_seq_len
    L, d = preset.n_layers, preset.d_model
    dense = an.attention_flops_per_token(L, T, d) * exact(tokens)
    return {"seq_len": T, "flops_attention": dense, "flops_attention_causal": dense // 2
            if isinstance(dense, int) else dense / 2}


@estimate.command("train")
@click.option("--params", type=COUNT, help="Matmul parameters N (7B, 70e9).")
@click.option("--tokens", type=COUNT, required=True, help="Training tokens D (15T, 300B).")
@click.option("--gpu", callback=_gpu, metavar="NAME", help=f"GPU (default {DEFAULT_GPU}).")
@click.option("--gpus", type=POS_INT, default=1, show_default=True, help="Number of GPUs.")
@click.option("--mfu", type=FRACTION, default=DEFAULT_MFU, show_default=True,
              help="Model FLOP utilisation in (0, 1].")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True,
              help="Which peak of the GPU to use.")
@click.option("--peak-flops", type=FLOPS, help="Per-GPU peak FLOP/s (989.5T); beats --gpu.")
@click.option("--price", type=POS_FLOAT, help="Price per GPU-hour; adds the cost.")
@_preset_option
@click.option("--seq-len", type=POS_INT, help="Sequence length T of the attention term "
              "(with --preset; default its context).")
@_json_option
def train_cmd(params, tokens, gpu, gpus, mfu, dtype, peak_flops, price, preset, seq_len,
              as_json):
    """Training compute C = 6ND and time = C / (GPUs x peak x MFU), in days and GPU-hours.

    N is the parameters that take part in matmuls; with --preset and no --params, the
    preset's exact matmul N. --preset also adds the attention term 12*L*T*d per token.
    """
    n = _n_params(params, preset, matmul=True)
    gpu = gpu or gpu_part(DEFAULT_GPU)
    peak = _peak(gpu, dtype, peak_flops, "choose another --dtype or give --peak-flops")
    flops = an.training_flops(n, tokens)
    t = an.training_time(flops, peak_flops=peak, gpus=gpus, mfu=mfu, price_per_gpu_hour=price)
    notes = [f"peak {peak / 1e12:g} TFLOP/s per GPU "
             + ("(--peak-flops)" if peak_flops else f"({gpu.name} {dtype}, dense)"),
             f"MFU {mfu:g}" + (" (default; large runs see 0.3-0.6)" if mfu == DEFAULT_MFU else ""),
             "days and GPU-hours use C = 6ND only (attention term not included)",
             "cost = GPU-hours x --price" if price else "no cost: give --price per GPU-hour"]
    attn = _attention_terms(preset, seq_len, tokens)
    data = {"flops": flops, "flops_6nd": flops, **attn, **t.to_dict(), "params": n,
            "tokens": exact(tokens), "gpu": None if peak_flops else gpu.name,
            "dtype": dtype, "assumptions": notes}
    _whole(data, "flops", "flops_6nd", "flops_attention", "flops_attention_causal", "params", "tokens")
    rows = [["C", fmt_flops(flops), "6 * N * D"],
            ["N", fmt_count(n), "matmul params"], ["D", fmt_count(tokens), "tokens"]]
    if attn:
        rows += [["attention (dense)", fmt_flops(attn["flops_attention"]), "12*L*T*d * D"],
                 ["attention (causal)", fmt_flops(attn["flops_attention_causal"]), "half"]]
    rows += [["time", f"{t.days:,.1f} days", "C / (GPUs * peak * MFU)"],
             ["GPU-hours", f"{t.gpu_hours:,.3g}", f"time * {gpus} GPUs"]]
    if t.cost is not None:
        rows.append(["cost", f"{t.cost:,.0f}", "GPU-hours * price"])
    _emit(data, as_json, "Training compute and time", rows, notes)



def _zero_note(stage: int, gpus: int, default: bool) -> str:
    if gpus == 1:
        return "one GPU: nothing sharded (--gpus G to shard with ZeRO)"
    what = {0: "nothing sharded (replicated data parallel)",
            1: "optimizer state and master weights sharded",
            2: "optimizer state, master weights and grads sharded",
            3: "params, grads, master weights and optimizer state sharded"}[stage]
    tail = " (default; --zero 0 for replicated)" if default else ""
    return f"ZeRO-{stage} over {gpus} GPUs: {what}{tail}"


@estimate.command("memory")
@click.option("--params", type=COUNT, help="Parameters (7B); or --preset.")
@click.option("--optimizer", type=click.Choice(list(an.OPTIMIZERS)), default="adamw",
              show_default=True)
@click.option("--precision", type=click.Choice(list(an.PRECISIONS)), default="mixed",
              show_default=True, help="fp32; mixed (bf16 + fp32 master); bf16 (pure).")
@click.option("--gpus", type=POS_INT, default=1, show_default=True)
@click.option("--gpu", callback=_gpu, metavar="NAME", help="GPU whose memory to fit in.")
@click.option("--gpu-memory", type=BYTES, help="Memory per GPU (80GB, 80GiB).")
@click.option("--zero", type=click.Choice(["0", "1", "2", "3"]),
              help="ZeRO stage over --gpus (default 3: all state sharded).")
@_preset_option
@_json_option
def memory_cmd(params, optimizer, precision, gpus, gpu, gpu_memory, zero, preset, as_json):
    """Static training memory: params, grads, master weights, optimizer state.

    Per parameter by optimizer x precision, whole model and per GPU under ZeRO. With --gpu
    or --gpu-memory, also the largest model that fits and whether this one does.
    Activations are not included (they depend on batch and sequence length).
    """
    if gpu is not None and gpu_memory is not None:
        raise click.UsageError("give --gpu NAME or --gpu-memory SIZE, not both")
    n = _n_params(params, preset, matmul=False)
    stage = 3 if zero is None else int(zero)
    mem = an.static_memory(n, optimizer, precision, gpus=gpus, zero=stage)
    capacity = gpu.memory_bytes if gpu is not None else gpu_memory
    notes = [_zero_note(stage, gpus, zero is None),
             "static state only: activations, buffers and allocator slack not included"]
    data = {"bytes_per_param": mem.bytes_per_param, "total_bytes": mem.total_bytes,
            "breakdown": dict(mem.breakdown),
            "bytes_per_param_breakdown": an.bytes_per_param(optimizer, precision),
            "per_gpu_bytes": mem.per_gpu_bytes, "per_gpu_breakdown": dict(mem.per_gpu_breakdown),
            "params": mem.n_params, "optimizer": optimizer, "precision": precision,
            "gpus": gpus, "zero": stage,
            "weights_bytes": {k: an.weight_bytes(n, k) for k in WEIGHT_DTYPES if k != "tf32"}}
    rows = [[k, fmt_bytes(v), f"{an.bytes_per_param(optimizer, precision)[k]} B/param"]
            for k, v in mem.breakdown.items()]
    rows += [["total", fmt_bytes(mem.total_bytes), f"{mem.bytes_per_param} B/param * N"],
             ["per GPU", fmt_bytes(mem.per_gpu_bytes), f"ZeRO-{stage} over {gpus}"]]
    if capacity is not None:
        data.update(gpu_memory_bytes=capacity, gpu=gpu.name if gpu else None,
                    max_params=an.max_params(capacity, optimizer, precision, gpus=gpus,
                                             zero=stage),
                    fits=mem.per_gpu_bytes <= capacity)
        rows += [["max params", fmt_count(data["max_params"]), "GPU memory / per-GPU B/param"],
                 ["fits", "yes" if data["fits"] else "no", f"per GPU <= {fmt_bytes(capacity)}"]]
    rows += [[f"weights {k}", fmt_bytes(v, binary=True), "inference"]
             for k, v in data["weights_bytes"].items()]
    data["assumptions"] = notes
    _whole(data, "params", "max_params")
    _emit(data, as_json, f"Static training memory ({optimizer}, {precision})", rows, notes)



@estimate.command("kv-cache")
@click.option("--layers", type=POS_INT, help="Layers L.")
@click.option("--kv-heads", type=POS_INT, help="Key/value heads h_kv.")
@click.option("--head-dim", type=POS_INT, help="Head dimension d_h.")
@click.option("--tokens", type=POS_INT, help="Cached tokens per sequence (32768).")
@click.option("--batch", type=POS_INT, default=1, show_default=True)
@click.option("--dtype", type=click.Choice(list(KV_DTYPES)), default="bf16", show_default=True)
@_preset_option
@_json_option
def kv_cache_cmd(layers, kv_heads, head_dim, tokens, batch, dtype, preset, as_json):
    """KV-cache size: 2 * L * h_kv * d_h * bytes per token, times tokens and batch.

    --preset fills in L, h_kv, d_h and (as --tokens) its context length; flags override.
    """
    cfg = _transformer(preset, "--preset") if preset is not None else None
    layers = layers or (cfg and cfg.n_layers)
    kv_heads = kv_heads or (cfg and cfg.n_kv_heads)
    head_dim = head_dim or (cfg and cfg.head_dim)
    tokens = tokens or (cfg and cfg.max_seq_len)
    missing = [f for f, v in (("--layers", layers), ("--kv-heads", kv_heads),
                              ("--head-dim", head_dim), ("--tokens", tokens)) if not v]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or give --preset NAME)")
    kv = an.kv_cache(layers, kv_heads, head_dim, tokens, batch=batch, dtype=dtype)
    notes = ["one K and one V vector per KV head, layer and token; no paging overhead"]
    data = {**kv.to_dict(), "total_gib": kv.total_bytes / GiB, "assumptions": notes}
    rows = [["per token", f"{fmt_int(kv.bytes_per_token)} B = "
             f"{fmt_bytes(kv.bytes_per_token, binary=True)}",
             "2 * L * h_kv * d_h * bytes"],
            ["total", fmt_bytes(kv.total_bytes), f"per token * {tokens} tokens * {batch}"]]
    if cfg is not None and cfg.n_kv_heads != cfg.n_heads:
        mha = an.kv_cache(layers, cfg.n_heads, head_dim, tokens, batch=batch, dtype=dtype)
        data["total_bytes_without_gqa"] = mha.total_bytes
        rows.append(["without GQA", fmt_bytes(mha.total_bytes), f"h_kv = h = {cfg.n_heads}"])
    _emit(data, as_json, "KV cache", rows, notes)



@estimate.command("decode")
@click.option("--params", type=COUNT, help="Parameters whose weights are read (8.03B).")
@click.option("--gpu", callback=_gpu, required=True, metavar="NAME", help="GPU (H100, A100...).")
@click.option("--dtype", type=click.Choice(list(DTYPE_BYTES)), default="bf16", show_default=True)
@click.option("--batch", type=POS_INT, default=1, show_default=True, help="Sequences per step.")
@click.option("--matmul-params", type=COUNT,
              help="Params that multiply per token (non-embedding); default --params.")
@_preset_option
@_json_option
def decode_cmd(params, gpu, dtype, batch, matmul_params, preset, as_json):
    """Decode step time: max(weight bytes / bandwidth, 2 * N * batch / peak FLOP/s).

    With --preset, N is its exact matmul count (non-embedding, LM head included).
    """
    n = _n_params(params, preset, matmul=False)
    if matmul_params is None and preset is not None:
        matmul_params = an.count_params(preset).matmul
    peak = _peak(gpu, dtype, None, "choose another --dtype")
    est = an.decode_step(n, gpu, dtype=dtype, batch=batch, matmul_params=matmul_params,
                         peak_flops=peak)
    notes = [f"{gpu.name}: {gpu.bandwidth_bytes_per_s / 1e12:g} TB/s, {peak / 1e12:g} "
             f"TFLOP/s {dtype} dense; memory and compute overlap perfectly",
             "matmul N = --params (embedding counted as if it multiplied)"
             if matmul_params is None else "compute uses matmul N (embedding lookup excluded)",
             "KV-cache reads and attention FLOPs not included"]
    data = _whole({**est.to_dict(), "gpu": gpu.name, "assumptions": notes},
                  "n_params", "matmul_params", "weight_bytes")
    rows = [["weights", fmt_bytes(est.weight_bytes), f"N * {DTYPE_BYTES[dtype]} B"],
            ["memory time", f"{est.memory_s * 1e3:.3g} ms", "weights / bandwidth"],
            ["compute time", f"{est.compute_s * 1e6:.3g} us", "2 * N_matmul * batch / peak"],
            ["step", f"{est.ms_per_step:.3g} ms", f"max of the two ({est.bound}-bound)"],
            ["tokens/s", f"{est.tokens_per_s:,.0f}", "batch / step"],
            ["critical batch", f"{est.critical_batch:,.0f}", "memory time / compute time at 1"]]
    _emit(data, as_json, "Decode step", rows, notes)
