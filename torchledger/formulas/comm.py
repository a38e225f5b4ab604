"""Communication per training step: closed forms for data parallelism and ZeRO/FSDP.

Pure functions of sizes (no torch). Per step, per rank, for n data-parallel ranks, with P the
bytes of all the parameters as gathered (their dtype) and G the bytes of all the gradients as
reduced (ZeRO paper, Rajbhandari et al. 2020, section 7):

============ ======================================================= ============= ===========
strategy     collectives                                             sent / rank   bus / rank
============ ======================================================= ============= ===========
ddp (ZeRO-0) all-reduce G (bucketed) in backward                     G             2G(n-1)/n
zero1/zero2  reduce-scatter G in backward, all-gather P after step   G + P/n       (G+P)(n-1)/n
zero3/fsdp   all-gather P in forward and again in backward,          2P/n + G      (2P+G)(n-1)/n
             reduce-scatter G in backward
============ ======================================================= ============= ===========

"sent" is the logical payload a rank contributes (``totals.comm_bytes``: an all-reduce sends
its buffer, an all-gather its shard, a reduce-scatter its whole input); "bus" is NCCL-tests'
bus bytes (``algo_bytes x factor``: all-reduce 2(n-1)/n, all-gather, reduce-scatter and
all-to-all (n-1)/n, others 1), what a ring moves over each rank's link. With fp32 params and
grads (P = G = 4N) the bus bytes are 8N(n-1)/n for DDP, ZeRO-1 and ZeRO-2, and 12N(n-1)/n for
ZeRO-3: the 1.5x of the ZeRO paper.

    >>> comm_per_step(4096, gpus=4, strategy="ddp").bus_bytes      # 4096 * 2 * 3 / 4
    6144

FSDP2 and HSDP exactly (:func:`fsdp_comm_per_step`): P is the parameters padded to a multiple
of the shard group s in dim 0 (``fsdp_padded_bytes``) in ``param_dtype`` (mixed precision
gathers bf16: half the bytes), re-gathered in backward only for groups with
``reshard_after_forward=True`` (FSDP2's root keeps its parameters from forward to backward);
G the padded gradients in ``reduce_dtype`` (default ``param_dtype``). HSDP (replicate r x
shard s) adds one all-reduce of G/s over the r replicas.

Tensor parallelism, per layer, X = b x s x h x bytes of one activation
(:func:`tp_comm_per_layer`): forward one all-reduce of X after each row-parallel output (the
attention output projection and the MLP's down projection: 2); backward one all-reduce of X per
column-parallel *input conversion*. Megatron fuses Q/K/V and gate/up (2 per layer); PyTorch's
``ColwiseParallel`` on unfused q, k, v, gate and up projections converts each input on its
own, so its backward issues 5 all-reduces per layer, 3 more than Megatron: PyTorch's real
cost, not an accounting error. With sequence parallelism each all-reduce becomes an
all-gather (X/t sent) before a column-parallel block and a reduce-scatter (X sent) after a
row-parallel one, mirrored in backward; Megatron re-gathers the block input in backward for
the weight gradient, PyTorch keeps the gathered input saved instead (no backward re-gather;
its activation memory is larger: ``activations.pytorch_sp_layer_bytes``).

Expert parallelism, per MoE layer (:func:`ep_comm_per_layer`, torchledger's MoE with a fixed
capacity C = ceil(capacity_factor x N x k / E) of a rank's N tokens): the dispatch buffer of
E x C x d elements goes to the experts' ranks by one all-to-all and comes back by another
(combine), and their backwards are two more of the same size: 4 x E x C x d x bytes sent.

Context parallelism, per attention layer (:func:`cp_comm_per_layer`, the standard plan's
all-gather form: a rank holds T/cp of the sequence): K and V all-gathered in forward, each rank
sending its own part (its tokens x the K/V width), and their gradients reduce-scattered in
backward, each rank sending the whole sequence's (cp times that).

Known limitations: pipeline parallel traffic is not modelled here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["STRATEGIES", "bus_factor", "CommStep", "comm_per_step", "fsdp_padded_bytes",
           "fsdp_comm_per_step", "tp_comm_per_layer", "ep_comm_per_layer", "cp_comm_per_layer",
           "combine_steps"]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def bus_factor(op: str, n: int) -> tuple:
    """NCCL-tests' bus bandwidth factor of ``op`` over ``n`` ranks as (numerator, denominator):
    all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; the rest 1."""
    if n <= 0:
        return 1, 1
    if op == "all_reduce":
        return 2 * (n - 1), n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, n
    return 1, 1


@dataclass(frozen=True)
class CommStep:
    """Bytes one rank communicates in one step under ``strategy``."""

    strategy: str
    gpus: int
    sent: dict
    """Bytes this rank sends, by phase: forward, backward, optimizer, total."""
    algo_bytes: int
    bus_bytes: int
    ops: tuple = field(default_factory=tuple)
    """(op, phase, sent, algo_bytes, bus_bytes) per collective kind."""

    @property
    def total(self) -> int:
        return self.sent["total"]


def _op(op: str, phase: str, sent: int, algo: int, n: int) -> tuple:
    num, den = bus_factor(op, n)
    return (op, phase, sent, algo, algo * num // den)


def comm_per_step(param_bytes: int, grad_bytes: int | None = None, *, gpus: int,
                  strategy: str = "ddp", reshard_after_forward: bool = True) -> CommStep:
    """Closed-form communication of one step (see the module table).

    ``param_bytes``: P, all parameters as gathered (for FSDP, padded: ``fsdp_padded_bytes``);
    ``grad_bytes``: G, all gradients as reduced (default P); ``gpus``: n, the data-parallel
    group size; ``reshard_after_forward=False``: ZeRO-3/FSDP keeps the gathered parameters
    from forward to backward (one all-gather, not two).
    """
    key = str(strategy).lower()
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    if param_bytes < 0 or (grad_bytes is not None and grad_bytes < 0):
        raise ValueError(f"bytes must be >= 0, got {param_bytes!r}, {grad_bytes!r}")
    n, p = gpus, int(param_bytes)
    g = p if grad_bytes is None else int(grad_bytes)
    shard = -(-p // n)                  # a rank's share of an all-gather (rounded up)
    if key == "ddp":
        ops = [_op("all_reduce", "backward", g, g, n)]
    elif key in ("zero1", "zero2"):
        ops = [_op("reduce_scatter", "backward", g, g, n), _op("all_gather", "optimizer", shard, p, n)]
    else:
        ops = [_op("all_gather", "forward", shard, p, n)]
        if reshard_after_forward:
            ops.append(_op("all_gather", "backward", shard, p, n))
        ops.append(_op("reduce_scatter", "backward", g, g, n))
    sent = {"forward": 0, "backward": 0, "optimizer": 0}
    for _, phase, s, _, _ in ops:
        sent[phase] += s
    sent["total"] = sum(sent.values())
    return CommStep(strategy=key, gpus=n, sent=sent, algo_bytes=sum(o[3] for o in ops),
                    bus_bytes=sum(o[4] for o in ops), ops=tuple(ops))


def fsdp_padded_bytes(shapes, itemsize: int, gpus: int) -> int:
    """Bytes of parameters of ``shapes`` once FSDP2 pads each one's first dimension to a
    multiple of ``gpus`` (``fully_shard`` shards dim 0 with ``torch.chunk`` semantics, so
    every rank holds ceil(d0 / n) rows). A 0-dim parameter counts as one row of one element.

    >>> fsdp_padded_bytes([(130, 64)], 4, 8)        # ceil(130 / 8) = 17 rows: 17 * 8 * 64 * 4
    34816
    """
    total = 0
    for shape in shapes:
        shape = tuple(shape) or (1,)
        rest = 1
        for d in shape[1:]:
            rest *= int(d)
        total += -(-int(shape[0]) // gpus) * gpus * rest * itemsize
    return total


def _step(strategy: str, n: int, ops: list) -> CommStep:
    sent = {"forward": 0, "backward": 0, "optimizer": 0}
    for _, phase, s, _, _ in ops:
        sent[phase] += s
    sent["total"] = sum(sent.values())
    return CommStep(strategy=strategy, gpus=n, sent=sent, algo_bytes=sum(o[3] for o in ops),
                    bus_bytes=sum(o[4] for o in ops), ops=tuple(ops))


def fsdp_comm_per_step(gather_bytes: int, grad_bytes: int, *, shard_group: int, replicate_group: int = 1,
                       regather_bytes: int | None = None) -> CommStep:
    """FSDP2 (or HSDP with ``replicate_group`` > 1) per rank and step.

    ``gather_bytes``: P, the parameters as all-gathered (padded to a multiple of the shard
    group in dim 0, in ``param_dtype``); ``regather_bytes``: the part gathered again in
    backward (default P: every group reshards after forward; FSDP2's root does not);
    ``grad_bytes``: G, the padded gradients in ``reduce_dtype``. Sent: P/s forward, the
    regathered/s and G (the reduce-scatter's input) in backward, and under HSDP G/s once more
    (the all-reduce of this rank's reduced shard over the replicas).

    >>> fsdp_comm_per_step(800, 800, shard_group=4, replicate_group=2).sent
    {'forward': 200, 'backward': 1200, 'optimizer': 0, 'total': 1400}
    """
    s, r = int(shard_group), int(replicate_group)
    if s < 1 or r < 1:
        raise ValueError(f"shard_group and replicate_group must be >= 1, got {shard_group!r}, {replicate_group!r}")
    p, g = int(gather_bytes), int(grad_bytes)
    again = p if regather_bytes is None else int(regather_bytes)
    ops = [_op("all_gather", "forward", -(-p // s), p, s)]
    if again:
        ops.append(_op("all_gather", "backward", -(-again // s), again, s))
    ops.append(_op("reduce_scatter", "backward", g, g, s))
    if r > 1:
        ops.append(_op("all_reduce", "backward", -(-g // s), -(-g // s), r))
    return _step("hsdp" if r > 1 else "fsdp", s * r, ops)


def tp_comm_per_layer(tokens: int, hidden: int, *, tp: int, dtype_bytes: int = 2,
                      sequence_parallel: bool = False, column_inputs: int = 2,
                      row_outputs: int = 2) -> CommStep:
    """Tensor-parallel collectives of one Transformer layer on one rank (module docstring).

    ``tokens``: b x s on this rank's data-parallel share; ``column_inputs``: column-parallel
    input conversions per layer (2 Megatron, fused; 5 PyTorch's unfused q, k, v, gate, up);
    ``row_outputs``: row-parallel outputs (2). X = tokens x hidden x dtype_bytes.

    >>> tp_comm_per_layer(4, 8, tp=2, dtype_bytes=4).sent     # X = 128: 2 fwd + 2 bwd all-reduces
    {'forward': 256, 'backward': 256, 'optimizer': 0, 'total': 512}
    >>> tp_comm_per_layer(4, 8, tp=2, dtype_bytes=4, column_inputs=5).sent["backward"]   # PyTorch unfused
    640
    """
    t = int(tp)
    if t < 1:
        raise ValueError(f"tp must be >= 1, got {tp!r}")
    x = int(tokens) * int(hidden) * int(dtype_bytes)
    ops = []
    if not sequence_parallel:
        ops += [_op("all_reduce", "forward", x, x, t)] * row_outputs
        ops += [_op("all_reduce", "backward", x, x, t)] * column_inputs
    else:
        ops += [_op("all_gather", "forward", x // t, x, t)] * column_inputs
        ops += [_op("reduce_scatter", "forward", x, x, t)] * row_outputs
        ops += [_op("all_gather", "backward", x // t, x, t)] * row_outputs
        ops += [_op("reduce_scatter", "backward", x, x, t)] * column_inputs
    return _step("tp+sp" if sequence_parallel else "tp", t, ops)


def ep_comm_per_layer(tokens: int, hidden: int, *, n_experts: int, top_k: int, capacity_factor: float,
                      ep: int, dtype_bytes: int = 2) -> CommStep:
    """Expert parallelism's all-to-alls of one MoE layer on one rank (module docstring):
    dispatch and combine in forward, their transposes in backward, each sending the whole
    E x C x d buffer (the chunk a rank keeps included, as ``all_to_all_single`` takes it).

    >>> ep_comm_per_layer(64, 64, n_experts=4, top_k=2, capacity_factor=1.0, ep=4, dtype_bytes=4).sent
    {'forward': 65536, 'backward': 65536, 'optimizer': 0, 'total': 131072}
    """
    n = int(ep)
    if n < 1 or n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need ep >= 1 and 1 <= top_k <= n_experts, got {ep!r}, {top_k!r}, {n_experts!r}")
    capacity = math.ceil(capacity_factor * int(tokens) * top_k / n_experts)
    x = int(n_experts) * capacity * int(hidden) * int(dtype_bytes)
    ops = [_op("all_to_all", phase, x, x, n) for phase in ("forward", "forward", "backward", "backward")]
    return _step("ep", n, ops)


def cp_comm_per_layer(tokens: int, kv_width: int, *, cp: int, dtype_bytes: int = 2) -> CommStep:
    """Context parallelism's collectives of one attention layer on one rank (module docstring):
    ``tokens`` this rank's (b x T/cp), ``kv_width`` the K (= V) width on it (KV heads x head dim,
    a tp-th under tensor parallelism).

    >>> cp_comm_per_layer(16, 64, cp=4, dtype_bytes=4).sent      # K, V 16 x 64 x 4 = 4,096 each
    {'forward': 8192, 'backward': 32768, 'optimizer': 0, 'total': 40960}
    """
    n = int(cp)
    if n < 1:
        raise ValueError(f"cp must be >= 1, got {cp!r}")
    x = int(tokens) * int(kv_width) * int(dtype_bytes)
    ops = [_op("all_gather", "forward", x, x * n, n)] * 2 + [_op("reduce_scatter", "backward", x * n, x * n, n)] * 2
    return _step("cp", n, ops)


def combine_steps(strategy: str, gpus: int, steps) -> CommStep:
    """One CommStep of several (each parameter group's FSDP2 collectives, each layer's):
    their collectives together.

    >>> combine_steps("fsdp+ep", 4, [fsdp_comm_per_step(800, 800, shard_group=4)] * 2).total
    2400
    """
    return _step(strategy, int(gpus), [op for step in steps for op in step.ops])
