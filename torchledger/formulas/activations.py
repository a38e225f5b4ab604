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

Table 2 of the paper, per layer, t the tensor-parallel size (:func:`korthikanti_table2`)::

    no parallelism                              sbh(34 + 5as/h)
    tensor parallel                             sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel                  sbh(34/t + 5as/(ht))
    tensor parallel + selective recompute       sbh(10 + 24/t)
    tensor + sequence parallel + selective      sbh(34/t)
    full recompute                              sbh(2)

Tensor parallelism alone leaves 10sbh replicated on every rank (the two LayerNorm inputs
4sbh, the inputs of QKV and of the MLP's first linear 4sbh, the two dropout masks 2sbh);
sequence parallelism splits those along the sequence too. **What PyTorch saves instead**
(:func:`pytorch_sp_layer_bytes`): Megatron keeps the LayerNorm output sequence-sharded
(2sbh/t) and all-gathers it again in backward for the weight gradient; PyTorch's
``ColwiseParallel`` after ``SequenceParallel`` saves the all-gathered input itself (2sbh) for
the linear's backward. With the block input gathered once per attention and once per MLP
(torchtitan's ``PrepareModuleInput``), a PyTorch TP+SP layer keeps 2 x 2sbh(1 - 1/t) more:
sbh(34/t + 4(1 - 1/t) + 5as/(ht)); a plan that gathers per projection (``ColwiseParallel(
input_layouts=Shard(1))`` on each of q, k, v, gate, up) keeps one gathered copy each.

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
from fractions import Fraction

__all__ = ["korthikanti_layer_bytes", "korthikanti_cross_attention_bytes", "ActivationMemory", "activation_memory",
           "RECOMPUTE_MODES", "tensor_bytes", "korthikanti_table2", "TABLE2_ROWS", "pytorch_sp_layer_bytes"]

RECOMPUTE_MODES = ("none", "full", "sqrt", "selective")

#: Korthikanti et al. Table 2's rows (see the module docstring).
TABLE2_ROWS = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")


def _whole(x: Fraction):
    return int(x) if x.denominator == 1 else float(x)


def korthikanti_table2(seq_len: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                       row: str = "none", fused_attention: bool = False):
    """Bytes of one layer (16-bit) by Table 2's ``row`` (:data:`TABLE2_ROWS`), exact: an int
    when t divides, else a float. ``fused_attention=True`` drops the 5as^2b/t score term
    (flash/SDPA kernels keep no s x s matrix; the selective rows drop it by recomputing).

    s=2, b=1, h=4, a=2, t=2: sbh = 8; no parallelism 8 x (34 + 5*2*2/4) = 312; TP
    8 x (10 + 12) + 5*2*4*1/2 = 196; TP+SP 8 x 17 + 20 = 156; selective 176 and 136; full 16.

    >>> [korthikanti_table2(2, 1, 4, 2, tp=2, row=r) for r in TABLE2_ROWS]
    [312, 196, 156, 176, 136, 16]
    """
    if row not in TABLE2_ROWS:
        raise ValueError(f"row must be one of {', '.join(TABLE2_ROWS)}, got {row!r}")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a whole number >= 1, got {tp!r}")
    sbh = seq_len * batch * hidden
    t = Fraction(1, 1) if row == "none" else Fraction(tp)
    scores = 0 if fused_attention else Fraction(5 * heads * seq_len * seq_len * batch) / t
    linear = {"none": 34 * sbh, "tp": 10 * sbh + Fraction(24 * sbh) / t, "tp+sp": Fraction(34 * sbh) / t,
              "tp+selective": 10 * sbh + Fraction(24 * sbh) / t, "tp+sp+selective": Fraction(34 * sbh) / t,
              "full": 2 * sbh}[row]
    if row in ("tp+selective", "tp+sp+selective", "full"):
        scores = 0
    return _whole(linear + scores)


def pytorch_sp_layer_bytes(seq_len: int, batch: int, hidden: int, heads: int, *, tp: int,
                           gathered_inputs: int = 2, fused_attention: bool = False):
    """One layer under PyTorch's tensor + sequence parallelism (16-bit): Table 2's TP+SP row
    plus, for each of ``gathered_inputs`` all-gathered block inputs a column-parallel linear
    saves, 2sbh - 2sbh/t (it keeps the gathered tensor; Megatron keeps the shard and
    re-gathers in backward). 2 with torchtitan's plan (one gather per attention, one per MLP).

    s=2, b=1, h=4, a=2, t=2: TP+SP 156 + 2 x (16 - 8) = 172.

    >>> pytorch_sp_layer_bytes(2, 1, 4, 2, tp=2)
    172
    """
    base = Fraction(korthikanti_table2(seq_len, batch, hidden, heads, tp=tp, row="tp+sp",
                                       fused_attention=fused_attention))
    sbh = seq_len * batch * hidden
    return _whole(base + gathered_inputs * (2 * sbh - Fraction(2 * sbh, tp)))


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
                      recompute: str = "none", fused_attention: bool = False, tp: int = 1,
                      sequence_parallel: bool = False) -> ActivationMemory:
    """Activation bytes over ``n_layers`` layers (16-bit) under ``recompute``
    (none/selective/full/sqrt), on one rank of ``tp`` tensor-parallel ranks, with or without
    ``sequence_parallel``: the rows of Korthikanti's Table 2 (:func:`korthikanti_table2`).

    ``recompute="full"`` keeps 2*s*b*h bytes per layer, the layer inputs only;
    ``"selective"`` recomputes attention's score ops (the 5as^2b/t term goes).

    >>> activation_memory(2, 1, 4, 2, 3, tp=2, sequence_parallel=True).saved_bytes   # 3 x 156
    468
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, "
                         f"got {recompute!r}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("hidden", hidden),
                        ("heads", heads), ("n_layers", n_layers)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a whole number >= 1, got {tp!r}")
    if tp == 1 and not sequence_parallel and recompute != "selective":
        per_layer = korthikanti_layer_bytes(seq_len, batch, hidden, heads, fused_attention=fused_attention)
    else:
        prefix = "tp+sp" if sequence_parallel else "tp"
        row = prefix + "+selective" if recompute == "selective" else prefix
        per_layer = korthikanti_table2(seq_len, batch, hidden, heads, tp=tp, row=row,
                                       fused_attention=fused_attention)
    if recompute == "selective":
        recompute_kind = "none"         # what is kept is the row's; nothing more comes back at once
    else:
        recompute_kind = recompute
    inputs = tensor_bytes(batch, seq_len, hidden)
    saved, peak = _saved(per_layer, inputs, n_layers, recompute_kind)
    return ActivationMemory(per_layer_bytes=per_layer, n_layers=n_layers, recompute=recompute,
                            saved_bytes=saved, peak_bytes=peak)
