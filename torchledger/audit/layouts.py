"""The world and the plan an audit runs under: ``--world-size``/``--mesh`` resolved to a simulated
world, the layout with its plan options (``--precision``, ``--checkpointing``, micro-batches,
...), the model file's own ``AuditSpec.parallelize`` or the standard plan, gradient
accumulation and rank 0's part of a context-parallel sequence. Every failure is an
``AuditError`` (one line)."""
from __future__ import annotations

import contextlib
from typing import Optional

from ..record.tokens import infer_tokens
from .errors import USER_ERRORS, raised, where
from .spec import AuditError
from ..parallel.layout import parse_layout
from ..parallel.megatron_loss import LOSS_NOTE, megatron_cross_entropy
from ..parallel.plan import PlanError, apply_standard_plan, cp_inputs, find_decoder
from .world import WorldError, resolve_world

__all__ = ["resolve_layout", "resolve", "standard_plan", "parallelize", "accumulated", "cp_part", "batch_part",
           "keep_blocks", "decoder"]


def resolve_layout(world, mesh, plan):
    """The run's :class:`~torchledger.parallel.layout.Layout` (named dims and plan options), or
    None for a plain single-process audit with no plan options."""
    options = {k: v for k, v in (plan or {}).items() if v is not None}
    if world is None and not options:
        return None
    try:
        layout = parse_layout(mesh if mesh is not None else None, world[0] if world else 1)
        layout = layout.with_options(**options)
        if not layout.pipelined:
            # NB: --micro-batches/--global-batch without pp are gradient accumulation: the
            # record is one micro-batch's step and says how many the step accumulates
            given = [f for f, k in (("--virtual-stages", "virtual_stages"), ("--schedule", "schedule"))
                     if k in options and not (k == "virtual_stages" and options[k] == 1)]
            if given:
                raise WorldError(f"{', '.join(given)}: pipeline options, and the mesh has no pp dimension; "
                                 f"give --mesh with pp=N (e.g. --mesh dp=2,pp=4) or drop them")
    except WorldError as e:
        raise AuditError(str(e)) from None
    return layout


def decoder(model, layout, path: str):
    """The standard plan's decoder of ``model`` under ``layout`` (its ``--sequence-parallel``
    applied), or None; AuditError (one line) where the layout asks what the model cannot take."""
    try:
        return find_decoder(model, layout)
    except PlanError as e:
        raise AuditError(f"{path}: {e}") from None


def resolve(world_size, mesh, device):
    if world_size is None and mesh is None:
        return None
    try:
        return resolve_world(world_size, mesh, device)
    except WorldError as e:
        raise AuditError(str(e)) from None


def standard_plan(model, device_mesh, layout, path: str, seq_len=None, **kw):
    """The standard plan of ``layout`` (:mod:`torchledger.parallel.plan`); (model, notes)."""
    try:
        return apply_standard_plan(model, device_mesh, layout, seq_len=seq_len, **kw)
    except PlanError as e:
        raise AuditError(f"{path}: {e}") from None
    except (Exception, SystemExit) as e:
        raise AuditError(f"{path}: the standard plan for --mesh {layout.text()} {raised(e)}; give "
                         f"AuditSpec(parallelize=fn) with your own plan") from None


def parallelize(spec, model, world, path: str, layout=None, seq_len=None):
    """``AuditSpec.parallelize(model, mesh)`` at a simulated world size, else the standard
    plan of the layout; (model, plan notes)."""
    import torch
    (n, shape), device_mesh = world
    fn = spec.parallelize
    if fn is None:
        if n == 1 and (layout is None or (layout.checkpointing == "none" and layout.precision == "fp32")):
            return model, []
        return standard_plan(model, device_mesh, layout, path, seq_len)
    try:
        out = fn(model, device_mesh)
    except USER_ERRORS as e:
        raise AuditError(f"{where(e, path)}: AuditSpec.parallelize(model, mesh) {raised(e)} (mesh "
                         f"{'x'.join(map(str, shape))}, dims {', '.join(device_mesh.mesh_dim_names or ())})"
                         ) from None
    if not isinstance(out, torch.nn.Module):
        raise AuditError(f"{path}: AuditSpec.parallelize(model, mesh) returned {type(out).__name__}, "
                         f"expected the nn.Module (fully_shard returns it: end with `return model`)")
    return out, ["AuditSpec.parallelize (the model file's own plan)"]


def accumulated(layout, count) -> Optional[int]:
    """Micro-batches a step accumulates without pipeline parallelism (``--micro-batches M`` or
    ``--global-batch G`` = M x dp x the spec's batch): ``totals.micro_batches``; the record is
    one micro-batch's forward and backward and the optimizer step."""
    if layout is None or layout.pipelined or (layout.micro_batches is None and layout.global_batch is None):
        return None
    if layout.micro_batches is not None:
        return layout.micro_batches
    batch = count.tokens // count.seq_len if count.tokens and count.seq_len else 1
    per = layout.dp_degree * batch
    if layout.global_batch % per:
        raise AuditError(f"--global-batch {layout.global_batch}: not a multiple of dp x the spec's batch "
                         f"({layout.dp_degree} x {batch} = {per}); the spec's inputs are one micro-batch")
    return layout.global_batch // per


def cp_part(inputs, spec, layout, world):
    """Rank 0's part of the sequence under the standard plan's context parallelism."""
    if layout is None or spec.parallelize is not None or layout.size("cp") == 1:
        return inputs
    seq = infer_tokens(inputs).seq_len
    return cp_inputs(inputs, layout.size("cp"), 0, seq) if seq else inputs


def batch_part(inputs, spec, layout):
    """The spec's inputs at ``--micro-batch-size B``: every tensor whose first dim is the spec's
    batch (token ids, targets, masks) repeated or cut along it to B rows, its values kept (real
    token ids on a real device). Unchanged without the option or at the spec's own batch."""
    b = None if layout is None else layout.micro_batch_size
    if b is None:
        return inputs
    count = infer_tokens(inputs)
    batch = count.tokens // count.seq_len if count.tokens and count.seq_len else None
    if batch is None:
        raise AuditError(f"--micro-batch-size {b}: the spec's inputs have no [batch, sequence] token ids to "
                         f"resize; drop --micro-batch-size and set the batch in the model file")
    if b == batch:
        return inputs
    if spec.tokens:
        raise AuditError(f"--micro-batch-size {b}: the spec fixes AuditSpec.tokens={spec.tokens:,} for its "
                         f"batch of {batch}; drop tokens= from the spec (they are read off the inputs) or "
                         f"drop --micro-batch-size")
    import torch

    def resize(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch:
            reps = -(-b // batch)
            return x.repeat(reps, *([1] * (x.dim() - 1)))[:b] if reps > 1 else x[:b]
        if isinstance(x, dict):
            return {k: resize(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(resize(v) for v in x)
        return x
    return resize(inputs)


def keep_blocks(model, layout, path: str) -> None:
    """``Layout.blocks`` = N: the decoder's blocks past the first N dropped from its ModuleList
    (the forward runs the rest as it runs a shallower model of the same config). Nothing
    without the option. ``torchledger plan`` traces a layout twice this way, at two depths,
    and prices the model's own depth per block (``plan.evaluate``)."""
    n = None if layout is None else layout.blocks
    if n is None:
        return
    dec = find_decoder(model)
    if dec is None:
        raise AuditError(f"{path}: keeping the first {n} blocks needs a decoder the standard plan recognises, "
                         f"not {type(model).__name__}")
    if n > len(dec.blocks):
        raise AuditError(f"{path}: keeping the first {n} blocks of a decoder of {len(dec.blocks)}")
    del dec.blocks[n:]


def step_kernels(layout, applied: dict):
    """What the step's framework runs in place of PyTorch's functions, entered around the
    traced step: Megatron's cross-entropy under ``--kernels te``
    (:mod:`..parallel.megatron_loss`); nothing otherwise. ``applied`` counts what was taken."""
    if layout is not None and layout.megatron:
        return megatron_cross_entropy(applied)
    return contextlib.nullcontext()


def kernel_notes(applied: dict) -> list:
    """The plan notes of what :func:`step_kernels` swapped in and the step took."""
    return [LOSS_NOTE] if applied.get("cross_entropy") else []
