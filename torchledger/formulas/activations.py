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

Term by term (:func:`korthikanti_layer_terms`, :func:`llama_block_terms`): one layer's saved
tensors by name (:data:`LAYER_TERMS`), Korthikanti's GPT layer and a Llama block (RMSNorm,
grouped-query attention with RoPE through a fused kernel, SwiGLU, no dropout) under tensor,
sequence and context parallelism, so a measured layer that differs from the formula differs
by named tensors.

Known limitations:
  - the constants are Megatron's GPT layer (GELU MLP of 4h, dropout); SwiGLU, GQA, no
    dropout or fp32 activations shift them (:func:`llama_block_terms` for a Llama block).
    Measure with ``torchledger audit`` when it matters.
  - logits (b*s*V) and the loss are not included.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction

__all__ = ["korthikanti_layer_bytes", "korthikanti_cross_attention_bytes", "ActivationMemory", "activation_memory",
           "RECOMPUTE_MODES", "tensor_bytes", "korthikanti_table2", "TABLE2_ROWS", "pytorch_sp_layer_bytes",
           "LAYER_TERMS", "korthikanti_layer_terms", "llama_block_terms"]

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


#: One layer's saved tensors, in forward order (:func:`korthikanti_layer_terms`,
#: :func:`llama_block_terms`); a term a layer does not keep is 0.
LAYER_TERMS = ("attn_norm_input", "attn_norm_stats", "attn_input", "q", "k", "v", "scores",
               "attn_lse", "attn_out", "attn_dropout_mask", "mlp_norm_input", "mlp_norm_stats",
               "mlp_input", "mlp_act_input", "mlp_act_output", "mlp_up", "mlp_down_input",
               "mlp_dropout_mask")


def _check_split(**sizes) -> None:
    for name, (value, by) in sizes.items():
        if not isinstance(value, int) or value < 1 or value % by:
            raise ValueError(f"{name} must be a whole number >= 1 that {by} divides, got {value!r}")


def korthikanti_layer_terms(seq_len: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                            sp: bool = False, fused_attention: bool = False) -> dict:
    """Korthikanti's GPT layer (16-bit) by :data:`LAYER_TERMS`, in bytes, on one of ``tp``
    ranks: Table 2's no-parallelism row (tp 1), its TP row, or with ``sp`` what PyTorch's
    sequence parallelism keeps (:func:`pytorch_sp_layer_bytes`). The paper's section 4.1:

    - attention (11sbh + 5as^2b): QKV input 2sbh, Q and K for QK^T 2sbh each, the softmax
      output 2as^2b, its dropout mask as^2b and the dropout output 2as^2b (``scores``), V
      2sbh, the output projection's input 2sbh, the block's dropout mask sbh;
    - MLP (19sbh): the first linear's input 2sbh, GELU's input 8sbh, its output (the second
      linear's input) 8sbh, the dropout mask sbh;
    - the two LayerNorms' inputs, 2sbh each.

    Tensor parallelism splits the heads and the 4h: Q, K, V, scores, the output projection's
    input and GELU's by t; the norms' inputs, the QKV and MLP inputs and the dropout masks
    stay whole (10sbh). Sequence parallelism splits those by t too, except the two inputs a
    column-parallel linear keeps all-gathered under PyTorch (2sbh each).

    s=2, b=1, h=4, a=2, t=2, sp, fused: sbh = 8; norms 8 + 8, inputs 16 + 16, q k v out 8
    each, masks 4 + 4, GELU 32 + 32: 172 - 0 scores = pytorch_sp_layer_bytes(2, 1, 4, 2, tp=2).

    >>> sum(korthikanti_layer_terms(2, 1, 4, 2, tp=2, sp=True).values())
    172
    """
    _check_split(tp=(tp, 1), heads=(heads, tp))
    sbh, t = seq_len * batch * hidden, Fraction(tp)
    whole = t if sp else Fraction(1)          # what TP alone leaves whole on every rank
    terms = dict.fromkeys(LAYER_TERMS, Fraction(0))
    terms.update(attn_norm_input=2 * sbh / whole, attn_input=Fraction(2 * sbh), q=2 * sbh / t,
                 k=2 * sbh / t, v=2 * sbh / t, attn_out=2 * sbh / t, attn_dropout_mask=sbh / whole,
                 mlp_norm_input=2 * sbh / whole, mlp_input=Fraction(2 * sbh), mlp_act_input=8 * sbh / t,
                 mlp_down_input=8 * sbh / t, mlp_dropout_mask=sbh / whole)
    if not fused_attention:
        terms["scores"] = 5 * heads * seq_len * seq_len * batch / t
    return {k: _whole(v) for k, v in terms.items()}


def llama_block_terms(seq_len: int, batch: int, hidden: int, heads: int, kv_heads: int, d_ff: int, *,
                      tp: int = 1, sp: bool = False, cp: int = 1, head_dim=None, dtype_bytes: int = 2) -> dict:
    """A Llama block's saved tensors by :data:`LAYER_TERMS`, in bytes, on one rank, as PyTorch
    keeps them on a GPU: ``seq_len`` the rank's tokens of a sequence (T / cp), ``tp`` ranks of
    tensor parallelism (torchtitan's plan: q, k, v, gate, up column-parallel, o and down
    row-parallel; with ``sp`` the norms sequence-parallel and one all-gather of the block
    input per attention and per MLP), ``cp`` ranks of context parallelism (K and V all-gathered
    over them), activations of ``dtype_bytes``. The block (``models.transformer``)::

        x + o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x)))); h + down(silu(gate(n2(h))) * up(n2(h)))

    Each term (e = dtype_bytes; s b tokens, t tp, d_h the head dim; derivatives.yaml):

    - ``*_norm_input`` e sbh, /t under sp: ``_fused_rms_norm`` (CUDA) keeps its input, and
      ``*_norm_stats`` its rstd, fp32 one a row: 4sb (/t under sp);
    - ``attn_input``, ``mlp_input`` e sbh: the projections' shared input, whole (all-gathered
      under sp, never split by t);
    - ``q`` e sb a d_h / t; ``k``, ``v`` e (cp s) b kv d_h / t: the flash (or memory-efficient)
      kernel keeps q, k, v after RoPE (RoPE's multiplications keep only the cos/sin tables,
      one pair for all layers); K and V at the kv heads, all-gathered to cp s positions;
    - ``attn_lse`` 4 b (a/t) s: the kernel's logsumexp, fp32 one per query and head;
      ``scores`` 0: no s x s matrix is kept;
    - ``attn_out`` e sb a d_h / t: the kernel's output, kept by it and (a view of the same
      storage) by the output projection;
    - ``mlp_act_input`` e sb f / t: gate's output, SiLU's input; ``mlp_act_output`` and
      ``mlp_up`` e sb f / t each: the product's two factors; ``mlp_down_input`` e sb f / t: the
      product, the down projection's input;
    - ``*_dropout_mask`` 0: Llama has no dropout.

    s=8, b=1, h=16, a=4, kv=2, f=24, t=2, sp, cp=2 (d_h 4, bf16): norms 2 x 8 x 16 / 2 = 128 and
    rstd 4 x 8 / 2 = 16 each; inputs 2 x 8 x 16 = 256 each; q 2 x 8 x 4 x 4 / 2 = 128, k and v
    2 x (2 x 8) x 2 x 4 / 2 = 128 each, lse 4 x 8 x 4 / 2 = 64, out 128; the MLP's four
    2 x 8 x 24 / 2 = 192: 2 x 144 + 2 x 256 + 4 x 128 + 64 + 4 x 192 = 2,144.

    >>> sum(llama_block_terms(8, 1, 16, 4, 2, 24, tp=2, sp=True, cp=2).values())
    2144
    """
    head_dim = hidden // heads if head_dim is None else head_dim
    _check_split(tp=(tp, 1), cp=(cp, 1), heads=(heads, tp), kv_heads=(kv_heads, tp), d_ff=(d_ff, tp))
    e, t, sb = dtype_bytes, Fraction(tp), seq_len * batch
    local = t if sp else Fraction(1)          # the norms' rows on this rank: sb / t under sp
    terms = dict.fromkeys(LAYER_TERMS, Fraction(0))
    terms.update(attn_norm_input=e * sb * hidden / local, attn_norm_stats=4 * sb / local,
                 attn_input=Fraction(e * sb * hidden), q=e * sb * heads * head_dim / t,
                 k=e * cp * sb * kv_heads * head_dim / t, v=e * cp * sb * kv_heads * head_dim / t,
                 attn_lse=4 * sb * heads / t, attn_out=e * sb * heads * head_dim / t,
                 mlp_norm_input=e * sb * hidden / local, mlp_norm_stats=4 * sb / local,
                 mlp_input=Fraction(e * sb * hidden), mlp_act_input=e * sb * d_ff / t,
                 mlp_act_output=e * sb * d_ff / t, mlp_up=e * sb * d_ff / t, mlp_down_input=e * sb * d_ff / t)
    return {k: _whole(v) for k, v in terms.items()}


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
