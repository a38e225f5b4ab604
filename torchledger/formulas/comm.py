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

Known limitations: FSDP2 pads each parameter's first dimension to a multiple of n
(``fsdp_padded_bytes``) and does not re-gather the root module's parameters in backward
(``reshard_after_forward`` is False for the root); mixed precision gathers params in
``param_dtype`` and reduces grads in ``reduce_dtype`` (pass P and G in those dtypes);
tensor/pipeline parallel traffic is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STRATEGIES", "bus_factor", "CommStep", "comm_per_step", "fsdp_padded_bytes"]

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
