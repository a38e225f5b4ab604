"""Static training memory: bytes per parameter by optimizer and precision, ZeRO sharding.

"Static" is what lives for the whole run whatever the batch: parameters, gradients, fp32
master weights and optimizer state (docs/counting.md). Activations are separate
(:mod:`torchledger.formulas.activations`). Units: bytes; GB = 1e9, GiB = 2**30.

Precisions:
  - ``fp32``: params 4, grads 4, no master copy, optimizer state fp32.
  - ``mixed`` (bf16 mixed precision as in the reference table): params 2, grads 2,
    fp32 master weights 4, optimizer state fp32.
  - ``bf16`` (pure bf16, no master copy): params 2, grads 2, and optimizer state in the
    params' dtype, 2 bytes per value (our choice; e.g. AdamW 4 bytes, not 8).
Optimizer state values per parameter: sgd 0, sgd-momentum 1, adagrad 1 (sum of g^2),
rmsprop 1 (square_avg; no momentum or centering), adam/adamw 2 (exp_avg, exp_avg_sq),
adam8bit 2 values of 1 byte each whatever the precision.

ZeRO over G data-parallel GPUs (per-GPU bytes): stage 1 shards the optimizer state and the
master weights, stage 2 also the gradients, stage 3 also the parameters.

Per rank under a mesh (:func:`static_bytes_per_rank`, :func:`sharded_numel`), with ``s`` the
FSDP shard group (``dp``/torchtitan's dp_shard), ``r`` the replicate group (``dp_replicate``:
DDP, or HSDP's outer dim) and ``t`` the tensor-parallel group: a weight TP splits holds
16/(t*s) bytes per parameter on each rank (fp32 or mixed AdamW), one TP leaves whole
(norms, embeddings, often the head) 16/s; ``r`` divides nothing (HSDP 2x4: 16N/4, not 16N/8;
DDP: 16N). FSDP2 pads each parameter's dim 0 to a multiple of s, so rank 0 holds
ceil(d0/s) rows: at 4,096 ranks a 4,096 x 11,008 weight is one row each, a 32,000-row
embedding 8 rows (32,768 padded, +2.4%). Mixed precision under FSDP2 changes nothing here
(sharded parameters, gradients and optimizer state stay fp32; the bf16 copy is gathered).

    >>> static_memory(7e9).total_bytes            # fp32 + AdamW: 16 B/param
    112000000000

Known limitations:
  - Adam's scalar ``step`` per tensor, 8-bit Adam's quantisation scales, buffers, the CUDA
    context and allocator slack are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .flops import exact

__all__ = ["OPTIMIZERS", "PRECISIONS", "WEIGHT_DTYPES", "bytes_per_param", "StaticMemory",
           "static_memory", "max_params", "fits", "weight_bytes", "naive_fp32_training_bytes",
           "sharded_numel", "static_bytes_per_rank", "static_per_rank_closed_form", "mesh_groups"]

#: Optimizer -> number of state values per parameter.
OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2,
              "adamw": 2, "adam8bit": 2}
_EIGHT_BIT = {"adam8bit"}

#: Precision -> (param bytes, grad bytes, master bytes, optimizer-state bytes per value).
PRECISIONS = {"fp32": (4, 4, 0, 4), "mixed": (2, 2, 4, 4), "bf16": (2, 2, 0, 2)}

#: Bytes per weight for inference storage formats.
WEIGHT_DTYPES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}

_ZERO_SHARDS = {0: (), 1: ("optimizer", "master"), 2: ("optimizer", "master", "grads"),
                3: ("optimizer", "master", "grads", "params")}


def _check_choice(kind: str, value: str, choices) -> str:
    key = str(value).lower()
    if key not in choices:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(choices)}")
    return key


def bytes_per_param(optimizer: str = "adamw", precision: str = "fp32") -> dict:
    """Bytes per parameter by category: ``{"params", "grads", "master", "optimizer"}``.

    ``bytes_per_param("adam8bit", "mixed")`` -> 2 + 2 + 4 + 2 = 10.
    """
    opt = _check_choice("optimizer", optimizer, OPTIMIZERS)
    prec = _check_choice("precision", precision, PRECISIONS)
    p, g, master, state = PRECISIONS[prec]
    state = 1 if opt in _EIGHT_BIT else state
    return {"params": p, "grads": g, "master": master, "optimizer": OPTIMIZERS[opt] * state}


@dataclass(frozen=True)
class StaticMemory:
    """Static training memory of ``n_params`` parameters, whole model and per GPU."""

    n_params: float
    optimizer: str
    precision: str
    bytes_per_param: int
    """Sum of the categories, unsharded (16 for AdamW in fp32 or mixed)."""
    breakdown: Mapping[str, int]
    """Bytes per category for the whole model (params, grads, master, optimizer)."""
    total_bytes: int
    """Whole model, all GPUs together: n_params x bytes_per_param."""
    gpus: int = 1
    zero: int = 0
    per_gpu_breakdown: Mapping[str, float] = field(default_factory=dict)
    per_gpu_bytes: float = 0.0
    """Bytes each GPU holds after ZeRO sharding (= total_bytes with one GPU or zero=0)."""

    @property
    def per_gpu_bytes_per_param(self) -> float:
        return self.per_gpu_bytes / self.n_params


def _sharded(per_param: Mapping[str, int], gpus: int, zero: int) -> dict:
    if zero not in _ZERO_SHARDS:
        raise ValueError(f"zero must be one of 0, 1, 2, 3, got {zero!r}")
    return {k: (v / gpus if k in _ZERO_SHARDS[zero] else v) for k, v in per_param.items()}


def static_memory(n_params, optimizer: str = "adamw", precision: str = "fp32", *,
                  gpus: int = 1, zero: int = 0) -> StaticMemory:
    """Static bytes of training ``n_params`` parameters; see the module docstring.

    ZeRO-3 of 7.5B over 64 GPUs, AdamW: 16 * 7.5e9 / 64 = 1.875e9 bytes per GPU.
    """
    if not n_params > 0 or not gpus >= 1:
        raise ValueError(f"n_params must be > 0 and gpus >= 1, got {n_params!r}, {gpus!r}")
    per_param = bytes_per_param(optimizer, precision)
    n = exact(n_params)
    breakdown = {k: _whole(n * v) for k, v in per_param.items()}
    per_gpu = {k: n * v for k, v in _sharded(per_param, gpus, zero).items()}
    return StaticMemory(n_params=n, optimizer=optimizer.lower(), precision=precision.lower(),
                        bytes_per_param=sum(per_param.values()), breakdown=breakdown,
                        total_bytes=sum(breakdown.values()), gpus=gpus, zero=zero,
                        per_gpu_breakdown=per_gpu, per_gpu_bytes=sum(per_gpu.values()))


def _whole(x):
    return int(round(x)) if isinstance(x, float) else x


def max_params(gpu_memory_bytes: float, optimizer: str = "adamw", precision: str = "fp32", *,
               gpus: int = 1, zero: int = 0) -> int:
    """Most parameters whose static state fits in ``gpu_memory_bytes`` on each of ``gpus``.

    8 x 80 GB with 16 B/param: ZeRO-3 -> 640e9 / 16 = 40e9; zero=0 (replicated) -> 5e9.
    """
    per_param = _sharded(bytes_per_param(optimizer, precision), gpus, zero)
    # NB: round before flooring so 80e9 / 2.0 does not land on 39999999999 by float error.
    return math.floor(round(gpu_memory_bytes / sum(per_param.values()), 6))


def weight_bytes(n_params, dtype: str = "bf16"):
    """Bytes of the weights alone in ``dtype`` (fp32 4, bf16/fp16 2, fp8/int8 1, int4 0.5).

    Llama 3 8B (8,030,261,248 params) in bf16: 16,060,522,496 B = 15.0 GiB.
    """
    key = _check_choice("weight dtype", dtype, WEIGHT_DTYPES)
    return _whole(exact(n_params) * WEIGHT_DTYPES[key])


def naive_fp32_training_bytes(n_params: int, n_activations: int) -> int:
    """4 * (3*Np + Na): fp32 params, grads and one optimizer state value, plus activations."""
    return 4 * (3 * n_params + n_activations)


def fits(memory: StaticMemory, gpu_memory_bytes: Optional[float]) -> Optional[bool]:
    """Whether the per-GPU static bytes fit in ``gpu_memory_bytes`` (None if not given)."""
    if gpu_memory_bytes is None:
        return None
    return memory.per_gpu_bytes <= gpu_memory_bytes


def _chunk(d: int, n: int, k: int) -> int:
    """Rows chunk ``k`` of ``torch.chunk(d rows, n)`` holds: ceil(d/n), the last ones fewer or none."""
    c = -(-d // n)
    return max(0, min(c, d - k * c))


def sharded_numel(shape, *, tp: int = 1, tp_dim: int = -1, shard_group: int = 1, tp_rank: int = 0,
                  shard_rank: int = 0) -> int:
    """Elements a rank holds of a parameter of global ``shape``: tensor parallelism splits
    dim ``tp_dim`` over ``tp`` ranks (``torch.chunk``: ceil(d / tp) on rank 0; -1: no split),
    then FSDP2 splits dim 0 of that over ``shard_group`` ranks (ceil: the padded shard).
    ``tp_rank``/``shard_rank``: the rank's place in those groups (0 by default, whose share is
    the ceil; a last rank may hold fewer rows, FSDP2 pads its storage, not its tensor).

    >>> sharded_numel((130, 64), shard_group=8)              # ceil(130 / 8) = 17 rows x 64
    1088
    >>> sharded_numel((130, 64), tp=4, tp_dim=0, shard_group=2)   # ceil(ceil(130/4)/2) = 17
    1088
    >>> sharded_numel((130, 64), shard_group=8, shard_rank=7)     # 130 - 7 x 17 = 11 rows
    704
    """
    dims = [int(d) for d in shape] or [1]
    if tp > 1 and 0 <= tp_dim < len(dims):
        dims[tp_dim] = _chunk(dims[tp_dim], tp, tp_rank)
    if shard_group > 1:
        dims[0] = _chunk(dims[0], shard_group, shard_rank)
    n = 1
    for d in dims:
        n *= d
    return n


def static_bytes_per_rank(params, optimizer: str = "adamw", precision: str = "fp32", *,
                          tp_rank: int = 0, shard_rank: int = 0, optimizer_shards: int = 1) -> dict:
    """Static bytes (params + grads + master + optimizer state) on rank 0 of a mesh, from
    ``params`` rows ``(shape, tp, tp_dim, shard_group, replicate_group, trainable, ..., count)``
    (``totals.layout["params"]``): each row's :func:`sharded_numel` x the bytes per parameter
    of ``optimizer`` x ``precision`` (a frozen parameter: its weight only), on the rank at
    ``tp_rank``/``shard_rank`` in its groups (rank 0 by default). Returns
    ``{"bytes", "numel", "numel_unpadded"}``: ``numel`` the padded shards,
    ``numel_unpadded`` the same split as if every dim divided (global numel / (tp x s)).

    ``optimizer_shards`` d > 1 (Megatron's distributed optimizer): the master and optimizer
    bytes of each shard over d ranks (its first ceil(n/d) elements), the weight and gradient
    bytes whole.

    >>> static_bytes_per_rank([((130, 64), 1, -1, 8, 1, True, 1)])["bytes"]   # 17*64 x 16
    17408
    >>> static_bytes_per_rank([((10, 3), 1, -1, 1, 4, True, 1)], precision="mixed",
    ...                       optimizer_shards=4)["bytes"]                   # 30 x 4 + 8 x 12
    216
    """
    if not isinstance(optimizer_shards, int) or optimizer_shards < 1:
        raise ValueError(f"optimizer_shards must be a whole number >= 1, got {optimizer_shards!r}")
    per = bytes_per_param(optimizer, precision)
    whole_part = per["params"] + per["grads"]
    trained, frozen = sum(per.values()), per["params"]
    if optimizer_shards > 1:
        trained = whole_part
    out = {"bytes": 0, "numel": 0, "numel_unpadded": 0.0}
    for row in params:
        shape, tp, tp_dim, s, trainable, count = row[0], row[1], row[2], row[3], row[5], row[-1]
        n = sharded_numel(shape, tp=tp, tp_dim=tp_dim, shard_group=s, tp_rank=tp_rank,
                          shard_rank=shard_rank) * count
        whole = 1
        for d in shape:
            whole *= int(d)
        out["numel"] += n
        out["numel_unpadded"] += whole * count / (max(tp, 1) * max(s, 1))
        out["bytes"] += n * (trained if trainable else frozen)
        if trainable and optimizer_shards > 1:
            part = -(-(n // count) // optimizer_shards) * count
            out["bytes"] += part * (per["master"] + per["optimizer"])
    return out


def static_per_rank_closed_form(n_split, n_whole=0, *, shard_group: int = 1, replicate_group: int = 1,
                                tp: int = 1, optimizer: str = "adamw", precision: str = "fp32") -> float:
    """Static bytes per rank without padding: ``bpp x (n_split / (tp x s) + n_whole / s)``,
    ``n_split`` the parameters tensor parallelism splits, ``n_whole`` those it leaves whole.
    ``replicate_group`` (DDP, HSDP's outer dim) holds full copies and divides nothing.

    >>> static_per_rank_closed_form(1000, shard_group=4, replicate_group=2)   # HSDP 2x4: 16 x 1000 / 4
    4000.0
    >>> static_per_rank_closed_form(800, 200, tp=4)                           # TP 4 only: 16 x (200 + 200)
    6400.0
    """
    for name, v in (("shard_group", shard_group), ("replicate_group", replicate_group), ("tp", tp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    bpp = sum(bytes_per_param(optimizer, precision).values())
    return bpp * (n_split / (tp * shard_group) + n_whole / shard_group)


def mesh_groups(dp: int = 1, dp_replicate: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """The groups the references take, from a named mesh (``--mesh dp=..,cp=..,tp=..``):
    FSDP shards over ``dp x cp`` (torchtitan's ``dp_shard_cp``: context-parallel ranks hold the
    same weights, so FSDP shards over them too), ``dp_replicate`` replicates (DDP, HSDP's outer
    dim), ``tp`` splits the weights its plan shards; ``pp`` stages each hold their own layers
    (divide the parameters by stage before calling the per-rank forms); ``ep`` is passed on.

    >>> mesh_groups(dp=4, cp=2, tp=8, pp=9)
    {'shard_group': 8, 'replicate_group': 1, 'tp': 8, 'pp': 9, 'ep': 1}
    """
    for name, v in (("dp", dp), ("dp_replicate", dp_replicate), ("cp", cp), ("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"mesh dimension {name} must be a whole number >= 1, got {v!r}")
    return {"shard_group": dp * cp, "replicate_group": dp_replicate, "tp": tp, "pp": pp, "ep": ep}
