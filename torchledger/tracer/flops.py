"""FLOP formulas for aten ops: the per-op cost that a ``TorchDispatchMode`` tracer asks for.

``op_flops(func, args, kwargs, out)`` looks at the shapes of one dispatched op (real, meta or
fake tensors alike: data is read only for varlen attention, see below) and returns a
``FlopCount(kind, flops, flops_causal)``, or ``None`` when torchledger has no formula for the
op, so that the tracer can list it as uncounted rather than count it as zero. Conventions:
one FLOP is half a multiply-add, so a [M,K] x [K,N] matmul is 2*M*K*N; batched matmuls
multiply by the batch dims; the bias/``beta*self`` term of addmm, baddbmm, addmv and
convolution is not counted (the convention of ``torch.utils.flop_counter`` and of 6ND);
``alpha``/``beta`` are ignored. A convolution costs 2 x (output elements) x (C_in/groups x
kernel volume), padding taps included; a transposed one 2 x (input elements) x (C_out/groups x
kernel volume); its backward costs one forward for grad_input and one for grad_weight, as
``output_mask`` asks. A fused recurrent layer (cuDNN, MIOpen, oneDNN LSTM/GRU/RNN) costs
2 x rows (time steps x batch) x numel(weight matrices) forward, its backward twice that (once
when cuDNN is asked for no weight grads). Attention is counted dense, 2*B*Hq*Sq*Sk*(Dqk + Dv), with the QUERY
heads (GQA/MQA broadcast K/V heads); ``flops_causal`` is exactly half the dense figure when
the kernel is causal (the exact pair count T(T+1)/2 differs by a factor 1 + 1/T); backward is
counted as 2x forward (four score-sized matmuls: model FLOPs; the flash, efficient and cuDNN
kernels' recomputation of the scores, 2.5x forward in all, is added to hardware FLOPs by the
record builder, see :mod:`.flops_attention`). ``torch.nn.attention.varlen_attn`` is attention
too (its custom ops, dense and causal, as the flash varlen kernel it calls). Element-wise
work is approximate and low order (memory-bound):
1 FLOP per output element for pointwise ops, 1 per input element for reductions, softmax,
norms and losses, sum of list numels for ``_foreach_*`` ops, and a per-element constant for
fused optimizers that matches what their foreach path reports. Views, copies, indexing,
masking by position (tril/triu) and tensor factories are ``"free"`` (0 FLOPs); an embedding
lookup is free, its backward (a scatter-add) is element-wise.

Example::

    >>> a, b = torch.empty(4, 5, device="meta"), torch.empty(5, 6, device="meta")
    >>> op_flops(torch.ops.aten.mm.default, (a, b), {}, torch.empty(4, 6, device="meta"))
    FlopCount(kind='matmul', flops=240, flops_causal=240)

Known limitations:
    - Varlen attention (``cum_seq_q``/``cu_seqlens_q``) reads the offsets to sum Sq_i*Sk_i
      when they are real tensors (NB: a host sync on CUDA). With fake/meta offsets only an
      upper bound is possible: min(Tq*max_k, max_q*Tk, n*max_q*max_k, Tq*Tk), exact when all
      sequences have equal length.
    - Sliding windows (``window_size*``), ``seqused_k``/``seqlen_k`` and the content of an
      explicit attention mask are ignored: such attention is counted dense.
    - The math SDPA fallback (e.g. Dqk != Dv on CPU) reaches the tracer as bmm/softmax ops, so
      it is counted as "matmul" and never gets a causal discount.
    - ``_grouped_mm`` assumes the groups in ``offs`` cover every row/column; so do the
      custom grouped-matmul ops of other libraries registered in ``_CUSTOM`` (a custom op's
      inner aten ops never reach a dispatch mode, so each needs a formula of its own).
    - Counts are built from ``.shape``/``.numel()``: with symbolic shapes they are SymInts.
    - A custom op (outside aten) is counted only by a formula of ``_CUSTOM`` or one its
      author registered with ``torch.utils.flop_counter.register_flop_formula`` before the
      op was first traced; its own inner ops never reach a dispatch mode.
    - Composite ops (matmul, linear, einsum, conv2d) are costed through the ops they
      decompose into; they never reach a dispatch mode themselves.
    - The PyTorch 2.13 ``FlopCounterMode`` reads (B, S, H, D) ``_flash_attention_forward``
      shapes as (B, H, S, D) and ignores GQA in some paths; this module does not follow it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from .flops_attention import ATTENTION_OPS, VARLEN, attention_flops  # SDPA, flash, efficient, cuDNN, varlen

__all__ = ["FLOP_KINDS", "FlopCount", "op_flops", "grads_needed"]

FLOP_KINDS = ("matmul", "attention", "elementwise", "free")


class FlopCount(NamedTuple):
    """The cost of one dispatched op (a NamedTuple: cheap to build, hashable, JSON-friendly)."""

    kind: str
    """One of ``FLOP_KINDS``: "matmul" and "attention" make up ``totals.flops``."""
    flops: int
    """FLOPs (2 x multiply-adds); attention counted dense, with no causal discount."""
    flops_causal: int
    """Causal attention: ``flops // 2``; every other op: equal to ``flops``."""


_FREE = FlopCount("free", 0, 0)
Handler = Callable[[tuple, dict, Any], FlopCount]
_new = tuple.__new__  # NB: ~3x faster than FlopCount(...), whose __new__ parses keywords


def _matmul(n: int) -> FlopCount:
    return _new(FlopCount, ("matmul", n, n))


def _elementwise(n: int) -> FlopCount:
    return _new(FlopCount, ("elementwise", n, n))


def _free(args, kwargs, out) -> FlopCount:
    return _FREE


def _getter(func, name: str) -> Callable[[tuple, dict], Any]:
    """Fetch schema argument ``name`` from (args, kwargs). The dispatcher passes positional
    arguments positionally but drops trailing ones equal to their default, so fall back to it."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            default = arg.default_value
            if arg.kwarg_only:
                return lambda args, kwargs: kwargs.get(name, default)
            return lambda args, kwargs: args[i] if i < len(args) else kwargs.get(name, default)
    raise KeyError(f"{func} has no argument {name!r}")


def _numel(x) -> int:
    """numel of a tensor, of the first tensor of a tuple/list, else 0 (a Python scalar)."""
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (tuple, list)):
        for t in x:
            if isinstance(t, torch.Tensor):
                return t.numel()
    return 0


# --- matmul -------------------------------------------------------------------------------

def _contract(i: int, j: int) -> Handler:
    """mm/bmm family: A [..., M, K] x B [..., K, N] -> 2 * numel(A) * N."""
    def flops(args, kwargs, out):
        return _matmul(2 * args[i].numel() * args[j].shape[-1])
    return flops


def _matvec(i: int) -> Handler:
    """mv/addmv/dot/vdot: one multiply-add per element of the matrix (or vector)."""
    def flops(args, kwargs, out):
        return _matmul(2 * args[i].numel())
    return flops


_PACKED_X2 = frozenset(filter(None, [getattr(torch, "float4_e2m1fn_x2", None)]))


def _scaled_mm(args, kwargs, out) -> FlopCount:
    a, b = args[0], args[1]
    k_factor = 2 if a.dtype in _PACKED_X2 else 1  # fp4 "x2" dtypes hold two K values a byte
    return _matmul(2 * a.numel() * k_factor * b.shape[-1])


def _grouped_mm(args, kwargs, out) -> FlopCount:
    a, b = args[0], args[1]
    n = 2 * a.numel() * b.shape[-1]
    if a.dim() == 3 and b.dim() == 2:  # each of G groups of A meets only its own N_g columns
        n //= a.shape[0]
    return _matmul(n)


def _grouped_fallback(func, passes: int) -> Handler:
    """A grouped matmul run as one custom op: input [S, K] x weight [G, K, N] -> [S, N], the
    rows split among the G groups (2*S*K*N); its backward makes grad_input and grad_weight
    (``passes=2``). Read by argument name: callers pass some arguments as keywords."""
    a_get, w_get = _getter(func, "input"), _getter(func, "weight")

    def flops(args, kwargs, out):
        return _matmul(passes * 2 * a_get(args, kwargs).numel() * w_get(args, kwargs).shape[-1])
    return flops


def _trilinear(args, kwargs, out) -> FlopCount:
    """nn.Bilinear's op (and its three backward passes): i1, i2, i3 are unsqueezed at
    ``expand1..3`` to one rank and multiplied, summed over ``sumdim``: one multiply-add per
    element of their broadcast shape, e.g. [B,O,I,J] for x1 W x2: 2*B*O*I*J."""
    shapes = []
    for t, expand in zip(args[:3], args[3:6]):
        shape = list(t.shape)
        for d in sorted(expand):
            shape.insert(d, 1)
        shapes.append(shape)
    n = 1
    for sizes in zip(*shapes):
        n *= max(sizes)
    return _matmul(2 * n)


_MATMUL = {
    "mm": _contract(0, 1), "bmm": _contract(0, 1), "_int_mm": _contract(0, 1),
    "_scaled_mm": _scaled_mm,
    "addmm": _contract(1, 2), "baddbmm": _contract(1, 2), "addbmm": _contract(1, 2),
    "_addmm_activation": _contract(1, 2),
    "mv": _matvec(0), "dot": _matvec(0), "vdot": _matvec(0), "addmv": _matvec(1),
    "_grouped_mm": _grouped_mm, "_scaled_grouped_mm": _grouped_mm, "_trilinear": _trilinear,
}


# Custom ops (full schema name -> handler builder) whose matmuls run inside the op, out of a
# dispatch mode's sight. transformers' MoE experts fall back to this one (a loop of mm over the
# experts) on CPU with torch <= 2.8, on unaligned CPU tensors with torch <= 2.10, and under
# torch.compile with non-bf16 weights; uncounted, a Mixtral step loses 2/3 of its FLOPs.
_CUSTOM = {
    "transformers::grouped_mm_fallback": lambda func: _grouped_fallback(func, 1),
    "transformers::grouped_mm_fallback_backward": lambda func: _grouped_fallback(func, 2),
}


# --- convolution --------------------------------------------------------------------------

def _conv_cost(x, w, y, transposed: bool) -> int:
    """Every output element of a conv is a dot product of length C_in/groups x kernel volume
    = numel(w) / C_out; a transposed conv (weight [C_in, C_out/g, k...]) scatters every input
    element through numel(w) / C_in taps. Padding taps are counted."""
    return 2 * (x if transposed else y).numel() * (w.numel() // w.shape[0])


def _conv_forward(func, transposed: Optional[bool]) -> Handler:
    """``transposed=None``: read it from the schema's ``transposed`` argument."""
    names = [a.name for a in func._schema.arguments]
    x_get, w_get = _getter(func, names[0]), _getter(func, "weight")
    t_get = _getter(func, "transposed") if transposed is None else (lambda a, k: transposed)

    def flops(args, kwargs, out):
        return _matmul(_conv_cost(x_get(args, kwargs), w_get(args, kwargs), out,
                                  bool(t_get(args, kwargs))))
    return flops


def _conv_backward(args, kwargs, out) -> FlopCount:
    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #  output_padding, groups, output_mask): grad_output has the forward output's shape.
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], args[7], args[10]
    one = _conv_cost(x, w, grad_out, bool(transposed))
    return _matmul(one * (bool(mask[0]) + bool(mask[1])))  # NB: grad_bias (a sum) not counted


_CONV_FORWARD = {  # op name -> transposed (None: read the schema argument)
    "convolution": None, "_convolution": None, "convolution_overrideable": None,
    "cudnn_convolution": False, "mkldnn_convolution": False, "miopen_convolution": False,
    "miopen_depthwise_convolution": False, "_mps_convolution": False,
    "_slow_conv2d_forward": False, "slow_conv3d_forward": False, "thnn_conv2d": False,
    "slow_conv_dilated2d": False, "slow_conv_dilated3d": False,
    "_nnpack_spatial_convolution": False, "_conv_depthwise2d": False,
    "conv_depthwise3d": False,
    "cudnn_convolution_transpose": True, "miopen_convolution_transpose": True,
    "slow_conv_transpose2d": True, "slow_conv_transpose3d": True,
    "_mps_convolution_transpose": True,
}

# --- recurrent layers ---------------------------------------------------------------------

def _rnn_weight_numel(weights) -> int:
    """Elements of the weight matrices (2-D: w_ih, w_hh, LSTM's projection w_hr; not biases)."""
    return sum(w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2)


def _rnn(func, weights: tuple, passes: Callable[[tuple, dict], int]) -> Handler:
    """A fused recurrent kernel (cuDNN, MIOpen, oneDNN): every weight matrix of every layer and
    direction multiplies every row (time step x batch element; packed sequences: their total
    length), so one pass is 2 * rows * numel(weight matrices); ``passes`` is 1 forward, 2 for
    a backward that makes weight grads as well as data grads. The gate non-linearities inside
    the kernel are not counted (not even as element-wise)."""
    x_get = _getter(func, "input")
    w_gets = [_getter(func, n) for n in weights]

    def flops(args, kwargs, out):
        x = x_get(args, kwargs)
        n = 0
        for get in w_gets:
            w = get(args, kwargs)
            n += _rnn_weight_numel(w if isinstance(w, (list, tuple)) else (w,))
        return _matmul(passes(args, kwargs) * 2 * (x.numel() // x.shape[-1]) * n)
    return flops


def _rnn_backward_passes(func) -> Callable[[tuple, dict], int]:
    """cuDNN/MIOpen run the data backward (dx, dhx, dcx) always, the weight backward when
    ``output_mask[3]`` asks for it."""
    mask = _getter(func, "output_mask")
    return lambda args, kwargs: 1 + bool(mask(args, kwargs)[3])


_RNN = {  # op name -> handler builder
    "mkldnn_rnn_layer": lambda f: _rnn(f, ("weight0", "weight1"), lambda a, k: 1),
    # oneDNN's backward makes every gradient (input, weights, biases, states) each call
    "mkldnn_rnn_layer_backward": lambda f: _rnn(f, ("weight1", "weight2"), lambda a, k: 2),
    "_cudnn_rnn": lambda f: _rnn(f, ("weight",), lambda a, k: 1),
    "miopen_rnn": lambda f: _rnn(f, ("weight",), lambda a, k: 1),
    "_cudnn_rnn_backward": lambda f: _rnn(f, ("weight",), _rnn_backward_passes(f)),
    "miopen_rnn_backward": lambda f: _rnn(f, ("weight",), _rnn_backward_passes(f)),
}
# The fused cell kernels of nn.LSTMCell/GRUCell on CUDA take the gates the two linear layers
# made (counted as matmuls): what is left is gate arithmetic, ~1 FLOP per gate element.
_CELL_GATES = {
    "_thnn_fused_lstm_cell": "input_gates", "_thnn_fused_gru_cell": "input_gates",
    "_thnn_fused_lstm_cell_backward_impl": "workspace", "_thnn_fused_lstm_cell_backward": "workspace",
    "_thnn_fused_gru_cell_backward": "workspace",
    "_thnn_differentiable_lstm_cell_backward": "input_gates",
}

# --- element-wise -------------------------------------------------------------------------

def _pointwise(args, kwargs, out) -> FlopCount:
    return _elementwise(_numel(out))  # ~1 FLOP per output element


def _per_input(args, kwargs, out) -> FlopCount:
    return _elementwise(_numel(args[0]) if args else _numel(out))  # ~1 per input element


def _numel_of(func, name: str) -> Handler:
    get = _getter(func, name)
    return lambda args, kwargs, out: _elementwise(_numel(get(args, kwargs)))


def _foreach(args, kwargs, out) -> FlopCount:
    return _elementwise(sum(t.numel() for t in args[0]))  # ~1 per element of the list


def _fused_optimizer(func, base: int, extras: Dict[str, int]) -> Handler:
    """``base`` passes per parameter element, plus ``extras[arg]`` when that option is on:
    the count the same optimizer's foreach path gets under the 1-FLOP-per-element rule."""
    getters = [(_getter(func, a), n) for a, n in extras.items()]

    def flops(args, kwargs, out):
        per = base + sum(n for get, n in getters if get(args, kwargs))
        return _elementwise(per * sum(t.numel() for t in args[0]))
    return flops


_OPTIMIZERS = {  # op -> (passes per element, {option: extra passes when it is on})
    # Adam(W): lerp_ (m), mul_ + addcmul_ (v), sqrt, div_, add_ (eps), addcdiv_ (param);
    # weight decay adds a mul_ (AdamW) or an add (Adam); amsgrad a maximum
    "_fused_adam_": (7, {"weight_decay": 1, "amsgrad": 1}),
    "_fused_adamw_": (7, {"weight_decay": 1, "amsgrad": 1}),
    # SGD: add_ (param); momentum: mul_ + add_ (buffer); weight decay, nesterov: one add each
    "_fused_sgd_": (1, {"momentum": 2, "weight_decay": 1, "nesterov": 1}),
    # Adagrad: addcmul_ (sum), sqrt, add_ (eps), mul (lr), addcdiv_ (param)
    "_fused_adagrad_": (5, {"weight_decay": 1}),
}

_PER_INPUT = frozenset("""
    _softmax _log_softmax _safe_softmax _softmax_backward_data _log_softmax_backward_data
    native_layer_norm native_layer_norm_backward _fused_rms_norm _fused_rms_norm_backward
    native_group_norm native_group_norm_backward native_batch_norm native_batch_norm_backward
    _native_batch_norm_legit _native_batch_norm_legit_functional batch_norm_backward
    _native_batch_norm_legit_no_training _batch_norm_with_update _batch_norm_no_update
    cudnn_batch_norm cudnn_batch_norm_backward miopen_batch_norm miopen_batch_norm_backward
    native_dropout _fused_dropout cumsum cumprod logcumsumexp
    mse_loss mse_loss_backward l1_loss smooth_l1_loss smooth_l1_loss_backward huber_loss
    huber_loss_backward binary_cross_entropy binary_cross_entropy_backward
    binary_cross_entropy_with_logits log_sigmoid_forward log_sigmoid_backward glu glu_backward
""".split())
_NUMEL_OF = {  # ops that touch only part of their input: count the elements combined
    "nll_loss_forward": "target", "nll_loss_backward": "target",
    "nll_loss2d_forward": "target", "nll_loss2d_backward": "target",
    "embedding_dense_backward": "grad_output",  # a scatter-add of every grad row
    "index_add": "source", "index_add_": "source", "scatter_add": "src", "scatter_add_": "src",
    "scatter_reduce": "src", "scatter_reduce_": "src",
}


def _index_put(func) -> Handler:
    values, accumulate = _getter(func, "values"), _getter(func, "accumulate")

    def flops(args, kwargs, out):
        if accumulate(args, kwargs):
            return _elementwise(_numel(values(args, kwargs)))
        return _FREE
    return flops


# --- free ---------------------------------------------------------------------------------

_FREE_OPS = frozenset("""
    clone copy_ _copy_from _copy_from_and_resize _to_copy contiguous _pin_memory lift lift_fresh
    lift_fresh_copy detach alias _unsafe_view view t transpose permute reshape _reshape_alias
    as_strided expand slice select narrow split split_with_sizes chunk unbind squeeze unsqueeze
    unsafe_split unsafe_split_with_sizes unsafe_chunk
    cat stack index _unsafe_index index_select gather take masked_select masked_scatter
    index_fill index_fill_ embedding slice_backward select_backward slice_scatter select_scatter
    diagonal_scatter as_strided_scatter constant_pad_nd repeat repeat_interleave flip roll
    tril triu tril_ triu_ nonzero
    zeros ones empty empty_strided full arange scalar_tensor eye zeros_like ones_like
    empty_like full_like new_zeros new_ones new_empty new_empty_strided new_full fill_ zero_
    randn rand randint randperm randn_like rand_like randint_like normal normal_ uniform_
    bernoulli bernoulli_ random_ exponential_ _efficientzerotensor
    _local_scalar_dense set_ resize_ resize_as_ _resize_output_ record_stream
    _assert_async _assert_scalar _functional_assert_async _assert_tensor_metadata
    _linalg_check_errors
    sym_size sym_stride sym_numel sym_storage_offset size stride dim numel storage_offset
    is_contiguous is_strides_like_format is_non_overlapping_and_dense is_same_size
    sym_is_contiguous _has_compatible_shallow_copy_type
""".split())
_FREE_NAMESPACES = frozenset({"prim", "profiler"})
# Element-wise arithmetic that torch leaves without the pointwise tag (on every overload):
# floor_divide routes tokens to experts in transformers' MoE layers.
_UNTAGGED_POINTWISE = frozenset({"floor_divide", "floor_divide_"})


# --- resolution: once per OpOverload ------------------------------------------------------

def _packet_tags(namespace: str, name: str) -> set:
    """Tags of every overload of aten::``name`` (and of its functional twin for ``name_``):
    .out and in-place overloads are often left untagged although their math is the same."""
    tags: set = set()
    for n in (name, name[:-1]) if name.endswith("_") else (name,):
        packet = getattr(getattr(torch.ops, namespace), n, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            tags.update(getattr(packet, overload).tags)
    return tags


def _registered(func) -> Optional[Handler]:
    """A formula the user registered for a custom op with PyTorch's
    ``torch.utils.flop_counter.register_flop_formula`` (counted as matmul-class work, as
    ``FlopCounterMode`` does). Only for ops outside aten: aten ops use this module's own formulas.
    The registry is looked up only if that module was imported (registering imports it)."""
    counter = sys.modules.get("torch.utils.flop_counter")
    formula = getattr(counter, "flop_registry", {}).get(func.overloadpacket) if counter else None
    if formula is None:
        return None

    def flops(args, kwargs, out):
        return _matmul(int(formula(*args, **kwargs, out_val=out)))
    return flops


def _resolve(func) -> Optional[Handler]:
    schema = getattr(func, "_schema", None)
    if schema is None:  # a HigherOrderOperator or something else without a schema
        return None
    namespace, _, name = schema.name.partition("::")
    if namespace in _FREE_NAMESPACES:
        return _free
    if namespace != "aten":  # custom and collective ops: uncounted unless a formula is known
        if schema.name in VARLEN:      # before _registered: PyTorch registers these as plain work
            return attention_flops(func, _getter, FlopCount, **VARLEN[schema.name])
        if schema.name in _CUSTOM:
            return _CUSTOM[schema.name](func)
        return _registered(func)
    if name in _MATMUL:
        return _MATMUL[name]
    if name in _CONV_FORWARD:
        return _conv_forward(func, _CONV_FORWARD[name])
    if name == "convolution_backward":
        return _conv_backward
    if name in ATTENTION_OPS:
        return attention_flops(func, _getter, FlopCount, **ATTENTION_OPS[name])
    if name in _RNN:
        return _RNN[name](func)
    if name in _CELL_GATES:
        return _numel_of(func, _CELL_GATES[name])
    if name in _OPTIMIZERS:
        return _fused_optimizer(func, *_OPTIMIZERS[name])
    if name.startswith("_foreach_") or name == "_amp_foreach_non_finite_check_and_unscale_":
        return _free if name in ("_foreach_copy_", "_foreach_zero_") else _foreach
    if name in _PER_INPUT:
        return _per_input
    if name in _NUMEL_OF:
        return _numel_of(func, _NUMEL_OF[name])
    if name in ("index_put", "index_put_", "_unsafe_index_put"):
        return _index_put(func)
    if name in ("scatter", "scatter_"):  # .src/.value only move data; .reduce ones combine
        if "reduce" not in func._overloadname:
            return _free
        return _numel_of(func, "src" if "src" in [a.name for a in schema.arguments] else "index")
    if name in _FREE_OPS:
        return _free
    if name in _UNTAGGED_POINTWISE:
        return _pointwise
    tags = func.tags
    returns = schema.returns
    if (torch.Tag.view_copy in tags or torch.Tag.inplace_view in tags or (returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in returns))):
        return _free  # views and their functionalized *_copy twins: no arithmetic
    if torch.Tag.pointwise in tags:
        return _pointwise
    if torch.Tag.reduction in tags:
        return _per_input
    packet_tags = _packet_tags(namespace, name)
    if torch.Tag.pointwise in packet_tags:
        return _pointwise
    if torch.Tag.reduction in packet_tags:
        return _per_input
    return None


# --- gradients a matmul's backward makes ---------------------------------------------------

_ADD_FIRST = frozenset({"addmm", "baddbmm", "addbmm", "_addmm_activation", "addmv"})
_OPERANDS: Dict[int, Optional[tuple]] = {}


def _operand_slots(func) -> Optional[tuple]:
    """Positions of the two multiplied operands of a matmul or convolution (the bias or
    ``self`` of addmm-like ops excluded), or None for other matmul-class work (fused RNNs,
    trilinear, custom ops: counted as making every gradient)."""
    name = func._schema.name.partition("::")[2] if func._schema.name.startswith("aten::") else ""
    if name in _ADD_FIRST:
        return (1, 2)
    if name in _MATMUL and name != "_trilinear" or name in _CONV_FORWARD:
        return (0, 1)
    return None


def grads_needed(func, args) -> int:
    """How many gradient matmuls the backward of this forward matmul will run, each as costly
    as the forward (FLOP count conventions): one per multiplied operand that requires grad,
    0 under ``no_grad``. A frozen weight times an input that needs no grad makes none; a
    trainable weight (or one whose input needs grad) makes one; both make two (the 6ND case).
    Fused recurrent kernels and ops with no known operand slots count 2."""
    if not torch.is_grad_enabled():
        return 0
    slots = _OPERANDS.get(id(func), ())
    if slots == ():
        slots = _OPERANDS[id(func)] = _operand_slots(func)
        _RESOLVED.append(func)
    if slots is None:
        return 2
    return sum(1 for i in slots if i < len(args) and isinstance(args[i], torch.Tensor)
               and args[i].requires_grad)


# Keyed by id(func): OpOverload.__hash__ is Python code and costs more than a formula. The
# ops are pinned in _RESOLVED so that an id is never reused by another object.
_HANDLERS: Dict[int, Optional[Handler]] = {}
_RESOLVED: list = []


def handler_of(func) -> Optional[Handler]:
    """The formula of ``func``: ``handler(args, kwargs, out) -> FlopCount``, or None when
    torchledger has none (worked out once per op per process)."""
    try:
        return _HANDLERS[id(func)]
    except KeyError:
        try:
            handler = _resolve(func)
        except (KeyError, AttributeError):  # a schema this module does not understand
            handler = None
        _RESOLVED.append(func)
        _HANDLERS[id(func)] = handler
        return handler


def is_free(handler) -> bool:
    """``handler`` is the formula of ops with no arithmetic (views, metadata, data movement)."""
    return handler is _free


def is_pointwise(handler) -> bool:
    """``handler`` is the pointwise formula: one FLOP per element of the (first) output."""
    return handler is _pointwise


def op_flops(func, args: tuple, kwargs: Optional[dict], out: Any) -> Optional[FlopCount]:
    """The FLOPs of one dispatched op, or ``None`` when torchledger has no formula for it.

    ``func`` is the ``OpOverload`` seen by ``__torch_dispatch__``; ``args``/``kwargs`` are what
    it was called with, ``out`` what it returned. Only shapes are read (see the module doc)."""
    handler = _HANDLERS.get(id(func)) or handler_of(func)
    if handler is None:
        return None
    return handler(args, kwargs if kwargs is not None else {}, out)
