"""A layout: the named mesh of ``--mesh dp=4,cp=2,tp=8,pp=9`` and the options of the standard
plan and the pipeline schedule (``--virtual-stages``, ``--micro-batches``, ``--global-batch``,
``--schedule``, ``--checkpointing``, ``--precision``).

Dimension names (docs/layouts.md): ``dp`` shards (FSDP2, torchtitan's dp_shard),
``dp_replicate`` replicates (DDP; HSDP together with ``dp``), ``cp`` context parallel,
``tp`` tensor parallel, ``pp`` pipeline stages, ``ep`` expert parallel (MoE models). Their product is the
world size. The mesh is made in torchtitan's order, outermost first: pp, dp_replicate, dp,
ep, cp, tp (ranks of one tp group are neighbours: one node). ``ep`` ranks hold different
experts and see different data: for the dense weights they are data-parallel ranks too. The unnamed ``8x8`` keeps its
meaning (dims dp, tp; three dims pp, dp, tp).

    >>> parse_layout("dp=4,cp=2,tp=8,pp=9").names
    ('pp', 'dp', 'cp', 'tp')
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["Layout", "parse_layout", "DIM_ORDER", "SCHEDULES", "CHECKPOINTING", "PRECISIONS", "KERNELS",
           "PARAMS_16"]

#: Mesh dims, outermost first (torchtitan's ParallelDims order).
DIM_ORDER = ("pp", "dp_replicate", "dp", "ep", "cp", "tp")
#: Accepted aliases of the dims' names.
ALIASES = {"dp_shard": "dp", "fsdp": "dp", "ddp": "dp_replicate", "replicate": "dp_replicate"}
SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero-bubble")
CHECKPOINTING = ("none", "full", "selective-op", "selective-layer", "selective-attention")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-params", "fp16-params", "fp8")
#: Precisions with 16-bit weights and gradients and fp32 master weights in the optimizer
#: (Megatron, NeMo, DeepSpeed): the dtype the weights are stored in.
PARAMS_16 = {"bf16-params": "bfloat16", "fp16-params": "float16", "fp8": "bfloat16"}
#: The kernels the step is priced as: PyTorch eager, torch.compile's fusion of the model, or
#: Megatron-Core / NeMo with Transformer Engine.
KERNELS = ("eager", "compiled", "te")


#: Ranks a simulated world may have.
MAX_WORLD = 1 << 20
#: Dims a mesh may have (torchtitan's richest has five: pp, dp_replicate, dp_shard, cp, tp).
MAX_MESH_DIMS = 8


class WorldError(ValueError):
    """A bad ``--world-size``/``--mesh``: one line for the user."""


def mesh_dim_names(ndim: int) -> tuple:
    """The names of a mesh's dims (see the module docstring)."""
    if ndim == 1:
        return ("dp",)
    if ndim == 2:
        return ("dp", "tp")
    if ndim == 3:
        return ("pp", "dp", "tp")
    return tuple(f"dim{i}" for i in range(ndim))


def parse_mesh(text) -> tuple:
    """``"8x8"`` -> ``(8, 8)``; ``"64"`` -> ``(64,)``. WorldError on anything else."""
    s = str(text).strip().lower().replace("×", "x").replace("*", "x").replace(",", "x")
    if not re.fullmatch(r"[0-9]+(x[0-9]+)*", s):        # ASCII: \d takes '８' and '٨' too
        raise WorldError(f"--mesh: expected dims joined by x, e.g. 8x8 or 64, got {clip_input(text)}")
    parts = s.split("x")
    # NB: a dim longer than MAX_WORLD's digits is over it; int() of a 5,000-digit string
    # would raise Python's own digit-limit ValueError, and thousands of dims would build a
    # mesh of that many dimensions
    if len(parts) > MAX_MESH_DIMS or any(len(p.lstrip("0")) > len(str(MAX_WORLD)) for p in parts):
        raise WorldError(f"--mesh: at most {MAX_MESH_DIMS} dims of at most {MAX_WORLD:,} ranks in all, "
                         f"got {clip_input(text)}; give a shape such as 8x8")
    dims = tuple(int(d) for d in parts)
    if any(d < 1 for d in dims):
        raise WorldError(f"--mesh: every dim must be >= 1, got {text!r}")
    return dims


def clip_input(text, limit: int = 40) -> str:
    """``repr`` of user input, cut to ``limit`` characters (a 5,000-digit mesh in one line)."""
    r = repr(str(text))
    return r if len(r) <= limit else f"{r[:limit]}... ({len(str(text)):,} characters)"



def _error(message: str):
    return WorldError(message)


@dataclass(frozen=True)
class Layout:
    """A parallel layout: mesh dims (name, size), outermost first, and the plan's options."""

    dims: tuple = ()
    """((name, size), ...) in :data:`DIM_ORDER`; dims of size 1 are kept (a named dim given)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules); the model is split into pp x v."""
    micro_batches: Optional[int] = None
    """Micro-batches per step and pipeline; None: from ``global_batch``, else pp (1 without pp)."""
    global_batch: Optional[int] = None
    """Sequences per step over all data-parallel ranks; micro-batches = G / (dp x B)."""
    micro_batch_size: Optional[int] = None
    """B: sequences in one micro-batch of one data-parallel rank; the spec's inputs repeated or
    cut along their batch dim to B rows (``audit/layouts.batch_part``); None: as the spec has them."""
    schedule: str = "1f1b"
    """Pipeline schedule; ``interleaved`` when ``virtual_stages`` > 1 and 1f1b is asked."""
    checkpointing: str = "none"
    """Activation checkpointing of the standard plan (torchtitan's policies)."""
    precision: str = "fp32"
    """fp32; bf16-mixed / fp16-mixed (FSDP2's MixedPrecisionPolicy, autocast without FSDP);
    bf16 (parameters in bf16); bf16-params / fp16-params (16-bit weights and gradients, fp32
    master weights and optimizer state); fp8 (bf16-params, the blocks' GEMMs priced in fp8)."""
    kernels: str = "eager"
    """eager, compiled or te (:data:`KERNELS`): how the step's kernels are priced."""
    named: bool = True
    """False for the unnamed ``8x8`` form."""
    sequence_parallel: Optional[bool] = None
    """Tensor parallelism also splits the sequence between the blocks (Megatron's sequence
    parallelism, torchtitan's SP): True/False as ``--sequence-parallel on|off`` says; None: the
    standard plan's choice for the model (on for RoPE decoders, off for learned positions and
    Hugging Face decoders: ``parallel.plan.find_decoder``)."""
    blocks: Optional[int] = None
    """Keep only the decoder's first N blocks (``torchledger plan`` prices a layout from two
    such short traces, per block; ``audit/layouts.keep_blocks``); None: every block."""

    def __post_init__(self):
        for key in ("virtual_stages",):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _error(f"--virtual-stages: expected a whole number >= 1, got {v!r}")
        for key, flag in (("micro_batches", "--micro-batches"), ("global_batch", "--global-batch"),
                          ("micro_batch_size", "--micro-batch-size"), ("blocks", "blocks")):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise _error(f"{flag}: expected a whole number >= 1, got {v!r}")
        if self.micro_batches is not None and self.global_batch is not None:
            raise _error("--micro-batches and --global-batch both given; give one (the global batch "
                         "implies the micro-batches: G / (dp x the spec's batch))")
        if not (self.sequence_parallel is None or isinstance(self.sequence_parallel, bool)):
            raise _error(f"--sequence-parallel: expected on or off, got {self.sequence_parallel!r}")
        for key, choices, flag in (("schedule", SCHEDULES, "--schedule"),
                                   ("checkpointing", CHECKPOINTING, "--checkpointing"),
                                   ("precision", PRECISIONS, "--precision"),
                                   ("kernels", KERNELS, "--kernels")):
            if getattr(self, key) not in choices:
                raise _error(f"{flag}: expected one of {', '.join(choices)}, got {getattr(self, key)!r}")

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    @property
    def names(self) -> tuple:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple:
        return tuple(s for _, s in self.dims)

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def pipelined(self) -> bool:
        return self.size("pp") > 1

    @property
    def megatron(self) -> bool:
        """The step describes a Megatron-Core / NeMo run (``--kernels te``): its distributed
        optimizer, cross-entropy and pipeline buffers in place of PyTorch's."""
        return self.kernels == "te"

    @property
    def optimizer_shards(self) -> int:
        """Ranks the optimizer's state is split over, each updating its own part: Megatron's
        distributed optimizer (ZeRO-1, which ``--kernels te`` describes) over the replicated
        data-parallel ranks (``dp_replicate``; FSDP's ``dp`` already shards the weights); 1
        otherwise."""
        return self.size("dp_replicate") if self.megatron else 1

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks (each its own batch): dp x dp_replicate x ep."""
        return self.size("dp") * self.size("dp_replicate") * self.size("ep")

    @property
    def schedule_name(self) -> str:
        """The schedule run: ``1f1b`` with virtual stages > 1 is the interleaved 1F1B."""
        if self.virtual_stages > 1 and self.schedule == "1f1b":
            return "interleaved"
        return self.schedule

    def text(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.dims) if self.named else "x".join(map(str, self.shape))

    def replace(self, **kw) -> "Layout":
        return dataclasses.replace(self, **kw)

    def with_options(self, **options) -> "Layout":
        """This layout with the plan options that are not None."""
        return self.replace(**{k: v for k, v in options.items() if v is not None})


def parse_layout(text, world_size: Optional[int] = None) -> Layout:
    """``"dp=4,cp=2,tp=8,pp=9"`` (named) or ``"8x8"`` (unnamed) -> :class:`Layout`; None with a
    world size -> ``dp=N``. WorldError (one line) on anything else."""
    if text is None:
        n = world_size or 1
        return Layout(dims=(("dp", n),), named=False)
    if isinstance(text, Layout):
        return text
    if isinstance(text, tuple):
        return Layout(dims=tuple(zip(mesh_dim_names(len(text)), text)), named=False)
    s = str(text).strip().lower().replace(" ", "")
    if "=" not in s:
        shape = parse_mesh(text)
        return Layout(dims=tuple(zip(mesh_dim_names(len(shape)), shape)), named=False)
    sizes = {}
    for part in s.split(","):
        name, eq, value = part.partition("=")
        name = ALIASES.get(name, name)
        if not eq or not name or not value:
            raise _error(f"--mesh: expected name=size pairs joined by commas, e.g. dp=4,cp=2,tp=8,pp=9, "
                         f"got {text!r}")
        if name not in DIM_ORDER:
            raise _error(f"--mesh: unknown dimension {name!r} in {text!r}; known: "
                         f"{', '.join(DIM_ORDER)}")
        if name in sizes:
            raise _error(f"--mesh: dimension {name} given twice in {text!r}")
        sizes[name] = value
    names = [n for n in DIM_ORDER if n in sizes]
    for n in names:
        if not (sizes[n].isascii() and sizes[n].isdigit()):     # '８' and '٨' are digits too
            raise _error(f"--mesh: {n}={sizes[n]}: expected a whole number >= 1 (e.g. {n}=2) in {text!r}")
    # the sizes go through parse_mesh's own checks (>= 1, its caps)
    try:
        shape = parse_mesh("x".join(sizes[n] for n in names))
    except ValueError as e:
        raise _error(f"--mesh {text}: {str(e).replace('--mesh: ', '')}") from None
    return Layout(dims=tuple(zip(names, shape)))
