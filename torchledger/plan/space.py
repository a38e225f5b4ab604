"""The layouts ``torchledger plan`` searches: every factorisation of the GPUs into the asked
mesh dimensions that the model allows, the micro-batch size and count that make the global
batch, the activation checkpointing policy and the pipeline schedule. Pure Python, no torch:
what the model allows arrives as :class:`ModelFacts` (read off the model by ``plan.probe``).

A layout the model or the batch rules out is not a candidate: it is counted under its reason
(``"attention heads 32 not divisible by tp=3"``), once per mesh for the mesh's own reasons,
once per (mesh, micro-batch split) for a schedule's.

    >>> facts = ModelFacts(blocks=4, n_heads=4, n_kv_heads=2, d_ff=176, seq_len=32)
    >>> space = enumerate_space(facts, gpus=4, global_batch=8, gpus_per_node=8)
    >>> sorted({c.mesh for c in space.candidates})
    ['pp=1,dp=2,tp=2', 'pp=1,dp=4,tp=1', 'pp=2,dp=1,tp=2', 'pp=2,dp=2,tp=1', 'pp=4,dp=1,tp=1']
    >>> dict(space.rejected)
    {'key/value heads 2 not divisible by tp=4': 1, '1f1b needs at least pp micro-batches': 4}
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from ..formulas.schedules import schedule_problem
from ..parallel.layout import CHECKPOINTING, DIM_ORDER, KERNELS, PRECISIONS, SCHEDULES

__all__ = ["ModelFacts", "Candidate", "Space", "enumerate_space", "factorisations", "DEFAULT_DIMS",
           "DEFAULT_CHECKPOINTING", "DEFAULT_SCHEDULES", "MAX_VIRTUAL_STAGES"]

#: The mesh dimensions searched unless ``--dims`` says otherwise.
DEFAULT_DIMS = ("dp", "tp", "pp")
DEFAULT_CHECKPOINTING = ("none", "full")
DEFAULT_SCHEDULES = ("1f1b",)
#: Interleaved schedules try v = 2, 3, ... up to this many model chunks per pipeline rank.
MAX_VIRTUAL_STAGES = 4


@dataclass(frozen=True)
class ModelFacts:
    """What the model allows: read off its decoder (``parallel.plan.find_decoder``) and inputs."""

    blocks: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    seq_len: int
    experts: int = 0
    sequence_parallel: bool = False
    """TP also cuts the sequence between blocks (torchledger's RoPE decoders): T divides by cp x tp."""
    batch: int = 1
    """Sequences in the model file's inputs (one micro-batch as the file has it)."""
    alike_from: int = 0
    """The first block from which every block is alike (``plan.evaluate.block_signature``):
    0 or 1 lets a layout be traced at short depths and priced per block."""


@dataclass(frozen=True)
class Candidate:
    """One layout to price: ``audit --mesh MESH --micro-batch-size B --global-batch G ...``."""

    dims: tuple
    """((name, size), ...) in the mesh's order (:data:`~torchledger.parallel.layout.DIM_ORDER`)."""
    micro_batch_size: int
    micro_batches: int
    checkpointing: str
    schedule: Optional[str]
    virtual_stages: int = 1
    precision: str = "bf16-mixed"
    kernels: str = "eager"
    sequence_parallel: Optional[bool] = None
    """``--sequence-parallel``: True/False as the search was asked, None the plan's default."""

    @property
    def mesh(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    @property
    def dp_degree(self) -> int:
        """Ranks that each see their own data: dp x dp_replicate x ep (as ``Layout.dp_degree``)."""
        return self.size("dp") * self.size("dp_replicate") * self.size("ep")

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp_degree


@dataclass
class Space:
    candidates: list = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)


def factorisations(n: int, k: int) -> list:
    """Every ordered k-tuple of whole numbers >= 1 whose product is n.

    >>> factorisations(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    if k == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in factorisations(n // d, k - 1)]
    return out


def mesh_problems(facts: ModelFacts, dims: dict, gpus_per_node: int) -> list:
    """Why the model cannot run on this mesh (each reason one short phrase), or []."""
    tp, pp, cp, ep = (dims.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    out = []
    if tp > 1:
        for what, n in (("attention heads", facts.n_heads), ("key/value heads", facts.n_kv_heads),
                        ("MLP width", facts.d_ff)):
            if n % tp:
                out.append(f"{what} {n} not divisible by tp={tp}")
        if tp > gpus_per_node:
            out.append(f"tp={tp} spans nodes of {gpus_per_node} GPUs")
    if pp > 1 and facts.blocks % pp:
        out.append(f"blocks {facts.blocks} not divisible by pp={pp}")
    need = cp * (tp if facts.sequence_parallel else 1)
    if need > 1 and facts.seq_len % need:
        what = f"cp={cp}" if not facts.sequence_parallel else f"cp x tp = {need}"
        out.append(f"sequence {facts.seq_len} not divisible by {what}")
    if ep > 1:
        if not facts.experts:
            out.append(f"ep={ep} and the model has no experts")
        elif facts.experts % ep:
            out.append(f"experts {facts.experts} not divisible by ep={ep}")
    return out


def enumerate_space(facts: ModelFacts, gpus: int, global_batch: int, dims=DEFAULT_DIMS,
                    checkpointing=DEFAULT_CHECKPOINTING, schedules=DEFAULT_SCHEDULES,
                    precision: str = "bf16-mixed", kernels: str = "eager", gpus_per_node: int = 8,
                    virtual_stages=None, fixed=None, sequence_parallel=None) -> Space:
    """Every candidate layout of ``gpus`` GPUs for ``global_batch`` sequences a step, and the
    rejected ones counted by reason (a mesh's first problem, once per mesh; a schedule's,
    once per mesh and micro-batch split). ``virtual_stages``: the model chunks a pipeline
    rank the interleaved schedule tries (default 2 to :data:`MAX_VIRTUAL_STAGES`); ``fixed``:
    {dimension: size} held at that size (a narrower search; the other meshes are not
    candidates and not counted as rejected); ``sequence_parallel``: every candidate's
    ``--sequence-parallel`` (``facts`` read under the same choice)."""
    check_choices(dims, checkpointing, schedules, precision, kernels)
    check_fixed(dims, fixed, virtual_stages)
    names = [n for n in DIM_ORDER if n in dims]
    space = Space()
    for shape in factorisations(gpus, len(names)):
        sizes = dict(zip(names, shape))
        if any(sizes[n] != k for n, k in (fixed or {}).items()):
            continue
        problems = mesh_problems(facts, sizes, gpus_per_node)
        if problems:
            space.rejected[problems[0]] += 1
            continue
        d = sizes.get("dp", 1) * sizes.get("dp_replicate", 1) * sizes.get("ep", 1)
        if global_batch % d:
            space.rejected[f"global batch {global_batch} not divisible by data-parallel degree {d}"] += 1
            continue
        per_rank = global_batch // d
        for b in [x for x in range(1, per_rank + 1) if per_rank % x == 0]:
            _add_splits(space, facts, tuple(sizes.items()), b, per_rank // b, checkpointing, schedules,
                        precision, kernels, virtual_stages, sequence_parallel)
    return space


def _add_splits(space, facts, dims, b, m, checkpointing, schedules, precision, kernels, virtual_stages=None,
                sequence_parallel=None) -> None:
    """The candidates of one mesh at micro-batch size ``b`` and ``m`` micro-batches."""
    pp = dict(dims).get("pp", 1)
    if pp == 1:
        runs = [(None, 1)]
    else:
        runs = []
        for schedule in schedules:
            if schedule == "interleaved":
                tried = virtual_stages or range(2, MAX_VIRTUAL_STAGES + 1)
                stages = [v for v in tried if facts.blocks % (pp * v) == 0]
                if not stages:
                    space.rejected[f"interleaved needs pp x virtual stages dividing the blocks "
                                   f"({facts.blocks})"] += 1
            else:
                stages = [1]
            for v in stages:
                problem = schedule_problem(pp, v, m, schedule)
                if problem:
                    space.rejected[_schedule_reason(schedule, problem)] += 1
                else:
                    runs.append((schedule, v))
    for schedule, v in runs:
        for ckpt in checkpointing:
            space.candidates.append(Candidate(dims, b, m, ckpt, schedule, v, precision, kernels, sequence_parallel))


def _schedule_reason(schedule: str, problem: str) -> str:
    if "fewer micro-batches than stages" in problem:
        return f"{schedule} needs at least pp micro-batches"
    return f"{schedule} needs micro-batches a multiple of max(1, micro-batches // pp)"


def check_choices(dims, checkpointing, schedules, precision, kernels) -> None:
    """ValueError (one line) on a name that is not a dimension, policy, schedule, precision or
    kernel family; the caller turns it into a usage error."""
    for flag, given, known in (("--dims", dims, DIM_ORDER), ("--checkpointing", checkpointing, CHECKPOINTING),
                               ("--schedules", schedules, SCHEDULES), ("--precision", [precision], PRECISIONS),
                               ("--kernels", [kernels], KERNELS)):
        bad = [x for x in given if x not in known]
        if bad or not given:
            raise ValueError(f"{flag}: expected names from {', '.join(known)} joined by commas, got "
                             f"{','.join(map(str, given)) or 'nothing'}")
        if len(set(given)) != len(given):
            raise ValueError(f"{flag}: {','.join(given)} names one twice; give each once")


def check_fixed(dims, fixed, virtual_stages) -> None:
    """ValueError (one line) on a held dimension that is not searched or a size below 1, or a
    virtual stage count below 2."""
    for name, size in (fixed or {}).items():
        if name not in dims or not isinstance(size, int) or size < 1:
            raise ValueError(f"fixed: expected {{dimension: size}} with dimensions from {','.join(dims)} and "
                             f"sizes >= 1, got {name}={size}")
    bad = [v for v in (virtual_stages or ()) if not isinstance(v, int) or v < 2]
    if bad:
        raise ValueError(f"virtual_stages: expected model chunks a pipeline rank of 2 or more, got "
                         f"{','.join(map(str, bad))}")
