"""What the predictions read off a record: the transformer's shape (layers, widths, the
attention width) and, for encoder-decoder stacks, each stack's length and rows.

Pure functions over a ``StepRecord`` (its ``meta.config`` from :mod:`torchledger.tracer.shape`
and its per-module FLOPs), used by :mod:`.compare`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["Shape", "Lengths", "shape", "enc_dec_lengths", "seq_len", "attention_free", "ATTENTION_FREE"]


class Shape(NamedTuple):
    L: int
    """All layers (encoder + decoder for an encoder-decoder stack)."""
    d: int
    V: int
    d_attn: int
    n_enc: Optional[int] = None
    """Encoder / decoder layers of an encoder-decoder stack (T5, BART); None otherwise."""
    n_dec: Optional[int] = None
    attn_width: int = 0
    """Per layer, heads x (Q K^T head dim + x V head dim): 2 x d_attn unless they differ
    (multi-head latent attention); 0: take 2 x d_attn."""


#: What the attention predictions assume and an attention-free model (``meta.config.mixer``,
#: from :mod:`torchledger.tracer.shape`) does not have; the FLOPs row says it.
ATTENTION_FREE = ("no attention: 12LTd (attention's Q K^T and x V), 12Ld^2 (4d^2 of attention and "
                  "a 4d GELU MLP per layer) and Korthikanti's activations (GPT's layer) assume "
                  "attention blocks: not compared, and TL-CMP-001 has no reference to judge this step by")


def attention_free(record):
    """The sequence mixer of a model without attention (``"state-space"``), else None."""
    cfg = record.meta.get("config")
    return cfg.get("mixer") if isinstance(cfg, dict) else None


def shape(record):
    """(L, d, V, d_attn, n_enc, n_dec) of a recognised transformer, exact config or found from
    its modules; d_attn = heads x head dim, the width the attention term runs at (d unless the
    config sets a head_dim apart, as Gemma and T5 can); n_enc / n_dec only for encoder-decoder
    stacks (``tracer.shape``), where L = n_enc + n_dec. None for an attention-free model
    (:func:`attention_free`): its blocks are not a transformer's."""
    cfg = record.meta.get("config")
    if not cfg or cfg.get("kind") != "transformer" or attention_free(record):
        return None
    try:
        d = int(cfg["d_model"])
        if cfg.get("encoder_decoder"):
            n_enc, n_dec = int(cfg["n_encoder_layers"]), int(cfg["n_decoder_layers"])
            return Shape(n_enc + n_dec, d, int(cfg["vocab_size"]), int(cfg.get("d_attn") or d),
                          n_enc, n_dec)
        width = int(cfg["d_attn_qk"]) + int(cfg["d_attn_v"]) if cfg.get("d_attn_qk") and cfg.get("d_attn_v") else 0
        return Shape(int(cfg["n_layers"]), d, int(cfg["vocab_size"]), int(cfg.get("d_attn") or d),
                      attn_width=width)
    except (KeyError, TypeError, ValueError):
        return None


class Lengths(NamedTuple):
    """Sequence lengths and tokens of an encoder-decoder step."""
    t_enc: int
    t_dec: int
    d_enc: int
    d_dec: int
    how: str
    """Where t_enc and t_dec came from, for the rows' text."""


def _probe_rows(record, probe, batch) -> Optional[int]:
    """Rows a stack's first projection multiplied ([name, weight numel] from ``tracer.shape``):
    its forward FLOPs / (2 x numel), when that is a whole number of rows per sample."""
    if not probe or not batch:
        return None
    name, numel = probe
    for m in record.modules or []:
        if m.get("name") == name:
            fwd = int(m.get("flops_forward") or 0)
            rows, rest = divmod(fwd, 2 * int(numel))
            return rows if fwd and not rest and rows % batch == 0 else None
    return None


def _lm_head_rows(record, shape, batch) -> Optional[int]:
    """Decoder rows read off a module named ``lm_head`` called once (2*V*d x rows forward:
    logits at every decoder position)."""
    if not shape.V:                         # no vocabulary (a bare nn.Transformer): no LM head
        return None
    for m in record.modules or []:
        if str(m.get("name", "")).rsplit(".", 1)[-1] != "lm_head" or m.get("calls") != 1:
            continue
        per_row = 2 * shape.V * shape.d
        fwd = int(m.get("flops_forward") or 0)
        if batch and fwd and fwd % per_row == 0 and (fwd // per_row) % batch == 0:
            return fwd // per_row
        break
    return None


def enc_dec_lengths(record, shape, D, T) -> Optional[Lengths]:
    """Each stack's length, read off the record: the batch is D / T (D and T read off the
    token ids, whichever stack they feed); the encoder's rows off its first projection
    (``config.encoder_probe``: Whisper's encoder runs at its audio frames, not at the labels'
    length), else T; the decoder's off the LM head, else its first projection, else assumed
    equal to the encoder's."""
    if shape is None or shape.n_enc is None or not D or not T:
        return None
    cfg = record.meta.get("config") or {}
    batch = D // T if D % T == 0 else None
    enc = _probe_rows(record, cfg.get("encoder_probe"), batch)
    if enc is not None and enc != D:
        t_enc, how = enc // batch, (f"T_enc = {enc // batch:,} read off the encoder's first projection "
                                    f"(2*weight x {enc:,} rows forward)")
    else:
        t_enc, enc, how = T, D, f"T_enc = {T:,} (the token ids' length)"
    head = _lm_head_rows(record, shape, batch)
    if head is not None:
        return Lengths(t_enc, head // batch, enc, head,
                        f"{how}, T_dec = {head // batch:,} read off the LM head (2*V*d x {head:,} "
                        f"decoder rows forward)")
    dec = _probe_rows(record, cfg.get("decoder_probe"), batch)
    if dec is not None:
        return Lengths(t_enc, dec // batch, enc, dec,
                        f"{how}, T_dec = {dec // batch:,} read off the decoder's first projection "
                        f"(2*weight x {dec:,} rows forward)")
    return Lengths(t_enc, t_enc, enc, enc, f"{how}, T_dec assumed = T_enc = {t_enc:,} (no LM head or "
                                            f"decoder projection to read the decoder's length off)")


def seq_len(record):
    return (record.meta.get("audit") or {}).get("seq_len") or record.meta.get("seq_len")
