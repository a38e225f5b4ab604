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
"""
from __future__ import annotations

from ..record import Finding
from ..units import fmt_bytes

__all__ = ["check_gpu_fit", "HEADROOM"]

HEADROOM = 0.10


def check_gpu_fit(records, options=None) -> list:
    opts = options or {}
    if not records or not opts.get("gpu"):
        return []
    from ..formulas.hardware import get_gpu
    try:
        gpu = get_gpu(opts["gpu"])
    except (KeyError, ValueError):
        return []                             # the CLI has already said what the names are
    rec = records[-1]
    peak, memory = rec.totals.get("peak_bytes") or 0, gpu.memory_bytes
    if not peak or not memory:
        return []
    phase = rec.totals.get("peak_phase")
    where = "the optimizer step" if phase == "optimizer" else phase
    share = peak / memory
    what = (f"its peak, {fmt_bytes(peak)}{f' in {where}' if where else ''}, is "
            f"{f'{share:.1%}' if share >= 0.001 else 'under 0.1%'} of one {gpu.name}'s {fmt_bytes(memory)}")
    static = sum(rec.totals.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
    world = rec.totals.get("world_size") or (rec.meta.get("audit") or {}).get("world_size") or 1
    where_not, fixes = "on one GPU", "shard them (ZeRO/FSDP), "
    if world > 1:       # a distributed step: the peak is one rank's, each rank has its own GPU
        what = f"each rank's peak (rank {rec.totals.get('rank') or 0}'s), " + what[len("its peak, "):]
        where_not, fixes = f"at world size {world}", "shard over more ranks, "
    if peak > memory:
        return [Finding("TL-MEM-002", "error", f"the step does not fit {where_not}: {what}", measured=peak,
                        expected=memory,
                        hint=f"parameters, gradients and optimizer state alone are {fmt_bytes(static)}; "
                             f"{fixes}use mixed precision or a smaller optimizer state, "
                             f"checkpoint activations or shrink the batch")]
    if peak > (1 - HEADROOM) * memory:
        return [Finding("TL-MEM-002", "warning",
                        f"the step fits with less than {HEADROOM:.0%} to spare: {what}; the CUDA "
                        f"context, allocator rounding and fragmentation need room on top",
                        measured=peak, expected=memory,
                        hint="leave headroom: a smaller batch or activation checkpointing")]
    fits = f"the step fits at world size {world}" if world > 1 else "the step fits"
    return [Finding("TL-MEM-002", "info", f"{fits}: {what}", measured=peak, expected=memory)]
