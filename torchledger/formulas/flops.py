"""Training compute and time: C = 6ND, the attention term, days and GPU-hours.

Conventions (docs/counting.md):
  - FLOP = one multiply or one add, so a multiply-add is 2 FLOPs and a [B,D] x [D,K]
    matmul is 2*B*D*K.
  - N is the number of parameters that take part in matmuls (see
    :mod:`torchledger.formulas.params`: the LM head counts, embedding lookups do not);
    D is training tokens (batch x sequence length, summed over steps).
  - 6 = 2 (forward) + 4 (backward: grad wrt input and grad wrt weight) FLOPs per param
    per token.
  - attention scores and attention x V belong to no parameter; training adds
    12*L*T*d FLOPs per token (4*L*T*d forward) when counted **dense**, i.e. the full T x T
    score matrix as the kernels of ``is_causal=False`` compute it. A causal kernel that
    skips the masked half does **exactly half**: 6*L*T*d. Both are reported, named.
  - time = FLOPs / (GPUs x peak FLOP/s x MFU); days are 86,400 s; GPU-hours count every GPU.
  - cost = GPU-hours x a price the caller passes; there is no built-in price.

    >>> training_flops(70e9, 15e12)
    6.3e+24

Known limitations:
  - no pipeline bubbles, restarts or evaluation time; MFU stands in for all of them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

__all__ = ["training_flops", "attention_flops_per_token", "encoder_decoder_attention_flops",
           "TrainingTime", "training_time", "exact"]

SECONDS_PER_DAY = 86_400


def exact(x):
    """An int when ``x`` is a whole number (so 6ND of ``7e9`` stays exact), else ``x``.

    NB: parsing ``'8.03B'`` gives 8029999999.999999; a float within 1e-9 (relative) of a
    whole number counts as that number, so counts typed with suffixes stay whole.
    """
    if isinstance(x, float) and math.isfinite(x):
        nearest = round(x)
        if abs(x - nearest) <= 1e-9 * max(1.0, abs(x)):
            return int(nearest)
    return x


def training_flops(n_params, tokens):
    """C = 6*N*D. ``training_flops(175e9, 300e9)`` = 3.15e23 (exact int for whole inputs)."""
    return 6 * exact(n_params) * exact(tokens)


def attention_flops_per_token(n_layers: int, seq_len: int, d_model: int, *,
                              causal: bool = False, training: bool = True) -> int:
    """Attention-matrix FLOPs per token: 12*L*T*d for training (4*L*T*d forward only),
    counted dense; ``causal=True`` gives exactly half (the masked half skipped).

    Per layer and token, QK^T is 2*T*d and attention x V another 2*T*d forward; backward
    doubles it. Its ratio to the 6N term is about T / (6d) for a standard block.
    """
    per_token = (12 if training else 4) * n_layers * seq_len * d_model
    return per_token // 2 if causal else per_token


def encoder_decoder_attention_flops(n_encoder_layers: int, n_decoder_layers: int,
                                    encoder_len: int, decoder_len: int, d_attn: int,
                                    encoder_tokens: int, decoder_tokens: int, *,
                                    causal: bool = False, training: bool = True) -> int:
    """Attention-matrix FLOPs of one step of an encoder-decoder stack (T5, BART), in total
    (not per token). Each query token meets, per layer, as many keys as its attention reads,
    at 12*keys*d_attn FLOPs for training (4*keys*d_attn forward):

        encoder self-attention   12 * L_enc * T_enc * d_attn * D_enc
        decoder self-attention   12 * L_dec * T_dec * d_attn * D_dec
        decoder cross-attention  12 * L_dec * T_enc * d_attn * D_dec   (queries: decoder
                                 tokens; keys and values: the encoder's T_enc positions)

    with D_enc / D_dec the encoder / decoder tokens of the batch (batch x T). ``causal=True``
    halves the decoder self-attention only: the encoder and cross-attention see every
    position. t5-small, B=2, T_enc = T_dec = 128, d_attn 512: 3 x 6 x 12*128*512*256 =
    3,623,878,656 (18 attention calls of 201,326,592).
    """
    k = 12 if training else 4
    enc = k * n_encoder_layers * encoder_len * d_attn * encoder_tokens
    dec = k * n_decoder_layers * decoder_len * d_attn * decoder_tokens
    cross = k * n_decoder_layers * encoder_len * d_attn * decoder_tokens
    return enc + (dec // 2 if causal else dec) + cross


@dataclass(frozen=True)
class TrainingTime:
    """Wall time and GPU time of ``flops`` at ``gpus`` x ``peak_flops`` x ``mfu``."""

    flops: float
    gpus: int
    peak_flops: float
    """Per-GPU peak FLOP/s."""
    mfu: float
    seconds: float
    days: float
    gpu_hours: float
    price_per_gpu_hour: Optional[float] = None
    cost: Optional[float] = None
    """gpu_hours x price_per_gpu_hour; None when no price was given."""

    def to_dict(self) -> dict:
        return asdict(self)


def training_time(flops, *, peak_flops: float, gpus: int = 1, mfu: float = 0.5,
                  price_per_gpu_hour: Optional[float] = None) -> TrainingTime:
    """Time to do ``flops`` of work: seconds = flops / (gpus * peak_flops * mfu).

    70B x 15T tokens (6.3e24) on 1024 H100 at 989.5 TF and MFU 0.5: ~143.9 days.
    """
    for name, value in (("peak_flops", peak_flops), ("gpus", gpus), ("mfu", mfu)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if mfu > 1:
        raise ValueError(f"mfu is a fraction of peak in (0, 1], got {mfu!r}")
    seconds = float(flops) / (gpus * peak_flops * mfu)
    gpu_hours = seconds * gpus / 3600
    cost = gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None
    return TrainingTime(flops=flops, gpus=gpus, peak_flops=peak_flops, mfu=mfu,
                        seconds=seconds, days=seconds / SECONDS_PER_DAY, gpu_hours=gpu_hours,
                        price_per_gpu_hour=price_per_gpu_hour, cost=cost)
