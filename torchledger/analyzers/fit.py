"""TL-MEM-002: does the step's peak fit in one GPU's memory (``audit --gpu NAME``)?

In a distributed step (``audit --world-size N``, or a rank's own record) the peak is one
rank's, each rank on its own GPU: the finding answers "does this fit at world size N".

The peak is the tracer's: live tensor bytes (parameters, gradients, optimizer state,
activations, temporaries) at the step's highest point. A GPU needs more than that: the CUDA
context (a few hundred MiB), the caching allocator's rounding and fragmentation, and library
workspaces. So a peak that fits with less than ``HEADROOM`` (10%) to spare is a warning,
not a pass.

* error: the peak is larger than the GPU's memory: the step cannot run on one such GPU as
  it is (smaller batch, activation checkpointing, mixed precision, or sharding: ZeRO/FSDP);
* warning: it fits with less than 10% to spare;
* info: it fits, and by how much.

A first step (``--steps 1``, or the first record of a run) is not the steady one: the
optimizer makes its state (AdamW: 2 values per parameter) in its first ``step()``, after
forward and backward, so they ran without it. The verdict is then made on the steady
estimate, the forward and backward peaks plus that state (:func:`first_step_state`), and the
message says so; ``--steps 2`` or more measures the steady step.
"""
from __future__ import annotations

from ..record import Finding
from ..record.steady import first_step_state, steady_peak, steady_peak_phase
from ..units import fmt_bytes
from ..formulas.hardware import get_gpu

__all__ = ["check_gpu_fit", "HEADROOM", "first_step_state", "steady_peak"]

HEADROOM = 0.10


def check_gpu_fit(records, options=None) -> list:
    opts = options or {}
    if not records or not opts.get("gpu"):
        return []
    try:
        gpu = get_gpu(opts["gpu"])
    except (KeyError, ValueError):
        return []                             # the CLI has already said what the names are
    rec = records[-1]
    peak, memory = rec.totals.get("peak_bytes") or 0, gpu.memory_bytes
    if not peak or not memory:
        return []
    phase = rec.totals.get("peak_phase")
    measured = peak                       # the finding's figure; the verdict may be the steady estimate's
    made = first_step_state(rec)
    first = ""
    if made:
        steady, phase = steady_peak(rec, made), steady_peak_phase(rec, made)
        first = (f" (steady estimate: this is a first step, whose optimizer made its {fmt_bytes(made)} of "
                 f"state after backward; later steps hold it from the start: measured {fmt_bytes(peak)}, "
                 f"forward/backward peak + state = {fmt_bytes(steady)}; --steps 2 or more measures it)")
        peak = steady                     # NB: the verdict is the steady step's; measured stays measured
    where = "the optimizer step" if phase == "optimizer" else phase
    share = peak / memory
    what = (f"its peak, {fmt_bytes(peak)}{f' in {where}' if where else ''}, is "
            f"{f'{share:.1%}' if share >= 0.001 else 'under 0.1%'} of one {gpu.name}'s {fmt_bytes(memory)}"
            + first)
    static = sum(rec.totals.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
    world = rec.totals.get("world_size") or (rec.meta.get("audit") or {}).get("world_size") or 1
    where_not = "on one GPU"
    if world > 1:       # a distributed step: the peak is one rank's, each rank has its own GPU
        what = f"each rank's peak (rank {rec.totals.get('rank') or 0}'s), " + what[len("its peak, "):]
        where_not = f"at world size {world}"
    if peak > memory:
        return [Finding("TL-MEM-002", "error", f"the step does not fit {where_not}: {what}", measured=measured,
                        expected=memory,
                        hint=f"parameters, gradients and optimizer state alone are {fmt_bytes(static)}; "
                             + _fixes(rec, world))]
    if peak > (1 - HEADROOM) * memory:
        return [Finding("TL-MEM-002", "warning",
                        f"the step fits with less than {HEADROOM:.0%} to spare: {what}; the CUDA "
                        f"context, allocator rounding and fragmentation need room on top",
                        measured=measured, expected=memory,
                        hint="leave headroom: a smaller batch or activation checkpointing")]
    fits = f"the step fits at world size {world}" if world > 1 else "the step fits"
    return [Finding("TL-MEM-002", "info", f"{fits}: {what}", measured=measured, expected=memory)]


#: What the step computes in when it is already 16-bit (or less): ``--precision`` as applied,
#: autocast seen in the step, or 16-bit weights.
_LOW = ("bf16", "fp16", "fp8", "bfloat16", "float16")


def _applied_precision(rec):
    """The reduced precision the step already runs in (``bf16-mixed``, ``autocast bfloat16``,
    ``bfloat16 weights``), or None for an fp32 step."""
    meta = rec.meta or {}
    applied = str((meta.get("audit") or {}).get("precision") or "")
    if applied.startswith(_LOW):
        return f"--precision {applied}"
    auto = str((meta.get("autocast") or {}).get("dtype") or "")
    if auto in _LOW:
        return f"autocast {auto}"
    dtype = str(meta.get("dtype") or "").replace("torch.", "")
    return f"{dtype} weights" if dtype in _LOW else None


def _fixes(rec, world: int) -> str:
    """The ways to fit that the step does not apply yet, and those it does."""
    fixes = ["shard over more ranks" if world > 1 else "shard them (ZeRO/FSDP)"]
    applied = []
    precision = _applied_precision(rec)
    if precision:
        applied.append(f"mixed precision ({precision})")
        fixes.append("a smaller optimizer state")
    else:
        fixes.append("use mixed precision or a smaller optimizer state")
    if ((rec.totals.get("flops") or {}).get("recompute") or 0) > 0:
        applied.append("activation checkpointing")
        fixes.append("shrink the batch")
    else:
        fixes.append("checkpoint activations or shrink the batch")
    return ", ".join(fixes) + (f" ({' and '.join(applied)} already applied)" if applied else "")


