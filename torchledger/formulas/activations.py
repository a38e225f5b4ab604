"""Activation memory of a Transformer: what the forward pass saves for backward.

Per layer, 16-bit activations, Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", no tensor or sequence parallelism)::

    s*b*h*(34 + 5*a*s/h) bytes  =  34*s*b*h + 5*a*s^2*b

with s sequence length, b batch, h hidden size, a attention heads. The 34*s*b*h part is
linear in s (inputs of the matmuls, norms, GELU, dropout masks); 5*a*s^2*b is the score
matrix per head (softmax output, its dropout mask and the dropout output). Fused attention
kernels (flash/SDPA) do not keep the s^2 part; ``fused_attention=True`` drops it.

Encoder-decoder stacks (T5, BART): an encoder layer is one Korthikanti layer at the encoder
length; a decoder layer is one at the decoder length plus its cross-attention block
(:func:`korthikanti_cross_attention_bytes`), the paper's attention-block tensors with the
queries on the decoder side and the keys and values on the encoder side.

Recomputation (activation checkpointing):
  - ``"full"``: keep only each layer's input, 2*s*b*h bytes (16-bit); recompute the layer in
    backward, so one layer's full activations are live again on top (``peak_bytes``).
  - ``"sqrt"``: keep every sqrt(L)-th layer's activations, the course's sqrt(L) x
    (one layer) figure: 80 layers of 200 MB -> 16 GB without, ~1.8 GB with.

    >>> korthikanti_layer_bytes(seq_len=2048, batch=1, hidden=4096, heads=32)
    956301312

Known limitations:
  - the constants are Megatron's GPT layer (GELU MLP of 4h, dropout); SwiGLU, GQA, no
    dropout or fp32 activations shift them. Measure with ``torchledger audit`` when it matters.
  - logits (b*s*V) and the loss are not included.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["korthikanti_layer_bytes", "korthikanti_cross_attention_bytes", "ActivationMemory", "activation_memory",
           "RECOMPUTE_MODES", "tensor_bytes"]

RECOMPUTE_MODES = ("none", "full", "sqrt")


def tensor_bytes(*shape: int, element_size: int = 2) -> int:
    """Bytes of a dense tensor: numel x element size. One B x T x H bf16 tensor = 2*B*T*H."""
    n = 1
    for dim in shape:
        n *= dim
    return n * element_size


def korthikanti_layer_bytes(seq_len: int, batch: int, hidden: int, heads: int, *,
                            fused_attention: bool = False) -> int:
    """s*b*h*(34 + 5*a*s/h) bytes of one layer in 16-bit, as an exact int.

    ``fused_attention=True`` leaves out the 5*a*s^2*b score-matrix term.
    """
    linear = 34 * seq_len * batch * hidden
    quadratic = 0 if fused_attention else 5 * heads * seq_len * seq_len * batch
    return linear + quadratic


def korthikanti_cross_attention_bytes(dec_len: int, enc_len: int, batch: int, hidden: int,
                                      heads: int, *, fused_attention: bool = False) -> int:
    """Bytes (16-bit) a decoder layer's cross-attention block adds to its Korthikanti layer:
    the paper's attention-block tensors (11sbh + 5as^2b) and one LayerNorm input (2sbh), with
    s_d = decoder length on the query side and s_e = encoder length on the key/value side::

        LayerNorm input 2*s_d*b*h, Q input 2*s_d*b*h, Q 2*s_d*b*h, K 2*s_e*b*h,
        softmax output 2*a*s_d*s_e*b, its dropout mask a*s_d*s_e*b, dropout output
        2*a*s_d*s_e*b, V 2*s_e*b*h, output projection input 2*s_d*b*h, dropout mask s_d*b*h
        = 9*s_d*b*h + 4*s_e*b*h + 5*a*s_d*s_e*b

    The K/V projections' input, the encoder output, is one tensor for all decoder layers and
    is not counted per layer. Equal lengths s: 13*s*b*h + 5*a*s^2*b. ``fused_attention=True``
    drops the 5*a*s_d*s_e*b score term.

        >>> korthikanti_cross_attention_bytes(2, 2, 3, 4, 2)
        432
    """
    linear = (9 * dec_len + 4 * enc_len) * batch * hidden
    quadratic = 0 if fused_attention else 5 * heads * dec_len * enc_len * batch
    return linear + quadratic


@dataclass(frozen=True)
class ActivationMemory:
    """Saved activations of ``n_layers`` layers."""

    per_layer_bytes: int
    """One layer without recomputation (Korthikanti)."""
    n_layers: int
    recompute: str
    saved_bytes: float
    """Bytes held between forward and backward under the recompute mode."""
    peak_bytes: float
    """``saved_bytes`` plus what recomputation brings back at once in backward."""

    def to_dict(self) -> dict:
        return asdict(self)


def _saved(per_layer: int, inputs_per_layer: int, n_layers: int, recompute: str) -> tuple:
    if recompute == "none":
        total = n_layers * per_layer
        return total, total
    if recompute == "full":
        kept = n_layers * inputs_per_layer
        return kept, kept + per_layer
    # NB: the course's sqrt(L) x one layer; the checkpointed block inputs are left out.
    kept = math.sqrt(n_layers) * per_layer
    return kept, kept


def activation_memory(seq_len: int, batch: int, hidden: int, heads: int, n_layers: int, *,
                      recompute: str = "none", fused_attention: bool = False) -> ActivationMemory:
    """Activation bytes over ``n_layers`` layers (16-bit) under ``recompute`` (none/full/sqrt).

    ``recompute="full"`` keeps 2*s*b*h bytes per layer, the layer inputs only.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, "
                         f"got {recompute!r}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden),
                        ("heads", heads), ("n_layers", n_layers)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    per_layer = korthikanti_layer_bytes(seq_len, batch, hidden, heads,
                                        fused_attention=fused_attention)
    inputs = tensor_bytes(batch, seq_len, hidden)
    saved, peak = _saved(per_layer, inputs, n_layers, recompute)
    return ActivationMemory(per_layer_bytes=per_layer, n_layers=n_layers, recompute=recompute,
                            saved_bytes=saved, peak_bytes=peak)
