"""TL-NET-001: how long a step's collectives take on a GPU's interconnect, beside its compute.

``audit --world-size N --gpu NAME`` (or ``--link-bandwidth``): the step's bus bytes (the
sum of ``collectives[].bus_bytes``, what a ring moves over each rank's link) over the bus
bandwidth one rank gets, next to ``totals.flops.total`` (this rank's FLOPs) over the GPU's
bf16 peak at an assumed MFU (``--mfu``, default 0.4). A record whose collectives carry no
bus bytes falls back to ``totals.comm_bytes.total`` (the payload this rank contributes),
and says so: for an all-gather that is a shard, (n-1) times less than the ring moves.

Convention: NCCL-tests' *bus bandwidth*. A ring all-reduce of S bytes over n ranks sends
2(n-1)/n x S from each rank, an all-gather or reduce-scatter (n-1)/n x S; NCCL-tests divide
those bytes (not S) by the time and call it busbw, and a well-tuned ring's busbw approaches
the slowest one-direction link a rank's ring traffic crosses. So time = bus bytes / link
bandwidth, with the link:

* within one node (N <= ``gpus_per_node``, 8): NVLink, per GPU, one direction
  (H100: 18 links x 25 GB/s = 450 GB/s; vendors quote 900 GB/s counting both directions);
* across nodes: min(NVLink, the node's InfiniBand, all NICs, one direction): NCCL runs one
  ring per NIC, and each node's share of the ring crosses the NICs once (DGX H100: 8 x 400
  Gb/s ConnectX-7 = 400 GB/s per node).

These are link peaks: measured NCCL-tests busbw is typically 80-95% of them, so the time is
a lower bound. Override with ``--link-bandwidth 360GB/s`` (a figure measured with
``all_reduce_perf`` on the target cluster is best).

    >>> comm_seconds(450e9, 450e9)
    1.0

With ``audit --gpu`` the record carries ``predictions.step_time`` and TL-NET-001 reads it
instead (``analyzers.steptime.comm_finding``): each collective timed by NCCL's alpha-beta model
on the link its group spans, groups that run at once sharing a node's NICs, and the part that
stays exposed after FSDP/DDP overlap. What follows is the form without a prediction (or with
``--link-bandwidth``).

Known limitations:
  - one bandwidth for the whole step: in a 2-D mesh (TP inside a node, FSDP across nodes)
    the TP collectives run on NVLink, faster than the inter-node figure used for them here;
  - no latency term (small collectives cost more than bytes / bandwidth), no in-network
    reduction (SHARP / NVLS), no overlap model: the real step takes between
    max(compute, comm) (perfect overlap, FSDP2's prefetch) and their sum.
"""
from __future__ import annotations

from ..formulas.interconnect import DEFAULT_MFU, LINKS, comm_seconds, compute_seconds, link_bandwidth
from ..record import Finding
from ..units import fmt_bytes
from ..formulas.hardware import get_gpu
from .steptime import comm_finding

__all__ = ["step_bus_bytes", "check_comm_time"]

_GB = 1e9

def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / _GB:,.0f} GB/s"


def _secs(s: float) -> str:
    """A duration in the unit that shows it: ``2.50 s``, ``196.4 ms``, ``2.35 ms``,
    ``12.6 us``, ``840 ns`` (a small step's collectives take microseconds: ``0.0 ms`` hid them)."""
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 10e-3:
        return f"{s * 1e3:.1f} ms"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e9:.3g} ns"


def _share(ratio: float) -> str:
    """``46% of compute``; ten times and more as ``11.7x compute``."""
    return f"{ratio:.0%} of compute" if ratio < 10 else f"{ratio:,.1f}x compute"


def step_bus_bytes(rec) -> tuple:
    """``(bytes, {phase: bytes}, kind)`` of one record's collectives: the sum of
    ``collectives[].bus_bytes`` (kind ``"bus bytes"``) when the rows carry it, else
    ``totals.comm_bytes`` (kind ``"payload bytes (no bus bytes in the record)"``), else
    ``(0, {}, "")``."""
    rows = [c for c in (getattr(rec, "collectives", None) or []) if isinstance(c, dict)]
    if rows and all(isinstance(c.get("bus_bytes"), (int, float)) for c in rows):
        phases: dict = {}
        for c in rows:
            phases[c.get("phase") or "other"] = phases.get(c.get("phase") or "other", 0) + c["bus_bytes"]
        return sum(phases.values()), phases, "bus bytes"
    comm = rec.totals.get("comm_bytes")
    total = comm.get("total") if isinstance(comm, dict) else None
    if not isinstance(total, (int, float)) or total <= 0:
        return 0, {}, ""
    phases = {k: v for k, v in comm.items() if k != "total" and isinstance(v, (int, float))}
    return total, phases, "payload bytes (no bus bytes in the record)"


def check_comm_time(records, options=None) -> list:
    """TL-NET-001 for the last record of a distributed step (``totals.comm_bytes``), when a
    GPU or a link bandwidth is given: info when compute outlasts communication (it can hide
    it), warning when communication alone outlasts compute (communication-bound)."""
    opts = options or {}
    if not records or not (opts.get("gpu") or opts.get("link_bandwidth")):
        return []
    rec = records[-1]
    total, phases, kind = step_bus_bytes(rec)
    if not total:
        return []                          # not distributed, or collectives not counted
    predicted = (rec.predictions or {}).get("step_time")
    if isinstance(predicted, dict) and not opts.get("link_bandwidth"):   # audit --gpu: the comm model
        return comm_finding(rec, predicted, total, kind)
    world = rec.totals.get("world_size") or (rec.meta.get("audit") or {}).get("world_size") or 1
    gpu = None
    if opts.get("gpu"):
        try:
            gpu = get_gpu(opts["gpu"])
        except (KeyError, ValueError):
            return []                      # the CLI has already said what the names are
    if opts.get("link_bandwidth"):
        bw, which = float(opts["link_bandwidth"]), "--link-bandwidth"
    else:
        link = LINKS.get(gpu.name)
        if link is None:
            return [Finding("TL-NET-001", "info",
                            f"{fmt_bytes(total)} of {kind} per step; no interconnect figures "
                            f"for {gpu.name} in the table, so no time",
                            hint="give --link-bandwidth (e.g. 450GB/s, an all_reduce_perf busbw)")]
        bw, which = link_bandwidth(link, world)
        which = f"{gpu.name} {which}"
        parts = _by_link(rec, link, world) if kind == "bus bytes" else None
        if parts and len(parts) > 1:       # a 2-D mesh: groups inside a node and across nodes
            return _verdict(rec, opts, gpu, world, total, kind, phases, parts)
        if parts and parts[0][1] != bw:    # one kind of group, on another link than the world's
            bw, which = parts[0][1], f"{gpu.name} {parts[0][2]}"
    t_comm = comm_seconds(total, bw)
    split = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in phases.items() if v)
    what = (f"{fmt_bytes(total)} of {kind} {_per(rec)} on each of {world} ranks' links "
            f"({split or 'no phase split'}) take {_secs(t_comm)} at {_rate(bw)} ({which}; NCCL-tests bus "
            f"bandwidth, a lower bound)")
    return _against_compute(rec, opts, gpu, what, t_comm)


def _per(rec) -> str:
    """What the record's bytes (and FLOPs) cover: the step, or under ``--micro-batches M`` the
    traced micro-batch of the step's M (compute beside it is that micro-batch's too)."""
    micro = int(rec.totals.get("micro_batches") or 1)
    return "per step" if micro <= 1 else f"per micro-batch (the traced one of the step's {micro})"


def _by_link(rec, link, world) -> list:
    """``[(bus bytes, bandwidth, which)]`` per kind of link the step's groups cross: a group
    whose ranks span no more than one node (``group_span``, ranks placed node by node as
    torchrun places them) runs over NVLink, a wider one across nodes; rows without a span take
    the world's link."""
    out: dict = {}
    for c in rec.collectives or []:
        span = c.get("group_span")
        if span is not None and span <= link.gpus_per_node:
            key = (link.nvlink_bytes_per_s, "NVLink, groups within a node")
        elif span is not None:
            bw, which = link_bandwidth(link, max(span, link.gpus_per_node + 1))
            key = (bw, f"{which.split(',')[0]}, groups across nodes")
        else:
            key = link_bandwidth(link, world)
        out[key] = out.get(key, 0) + c["bus_bytes"]
    return [(b, bw, which) for (bw, which), b in sorted(out.items(), key=lambda kv: -kv[1])]


def _verdict(rec, opts, gpu, world, total, kind, phases, parts) -> list:
    t_comm = sum(comm_seconds(b, bw) for b, bw, _ in parts)
    split = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in phases.items() if v)
    links = "; ".join(f"{fmt_bytes(b)} at {_rate(bw)} ({gpu.name} {which})" for b, bw, which in parts)
    what = (f"{fmt_bytes(total)} of {kind} {_per(rec)} on each of {world} ranks' links "
            f"({split or 'no phase split'}) take {_secs(t_comm)}: {links} (NCCL-tests bus bandwidth, "
            f"a lower bound)")
    return _against_compute(rec, opts, gpu, what, t_comm)


def _against_compute(rec, opts, gpu, what, t_comm) -> list:
    flops = (rec.totals.get("flops") or {}).get("total") or 0
    peak = gpu.peak_flops.get("bf16") if gpu is not None else None
    mfu = float(opts.get("assumed_mfu") or DEFAULT_MFU)
    if not flops or not peak:
        return [Finding("TL-NET-001", "info", what, measured=t_comm)]
    t_compute = compute_seconds(flops, peak, mfu)
    ratio = t_comm / t_compute
    text = (f"{what}; compute, {flops:.3g} FLOPs at MFU {mfu:.0%} of {gpu.name}'s bf16 "
            f"{peak / 1e12:,.1f} TFLOP/s, takes {_secs(t_compute)}: communication is "
            f"{_share(ratio)}")
    if ratio > 1:
        return [Finding("TL-NET-001", "warning", text + " (communication-bound even with full overlap)",
                        measured=t_comm, expected=t_compute,
                        hint="more tokens per rank, a smaller data-parallel group (HSDP), or "
                             "keep TP inside a node")]
    return [Finding("TL-NET-001", "info", text + " (hideable if overlapped)", measured=t_comm,
                    expected=t_compute)]
