"""Predicted step time on a named part, from a traced step's ops and collectives.

``predict_step_time(record, gpu, options)`` prices every op row of the record with
:mod:`torchledger.formulas.steptime` (matmuls by their shapes, attention by the kernel the part
would run, memory-bound ops by their bytes, a launch floor per kernel), every collective with
NCCL's cost model on the link its group spans, and lays them on two streams the way the
framework schedules them:

* FSDP (all-gathers of a module in forward and backward, reduce-scatters in backward): the
  module's units in ``named_modules()`` order, each unit's all-gather prefetched under the
  previous unit's compute and its reduce-scatter under the next units' backward
  (``formulas.steptime.overlap_timeline``); collectives of modules that are not units (the
  root's, after the last block) are exposed;
* DDP / HSDP all-reduces in backward without FSDP units: buckets issued evenly through the
  backward (the reducer fires a bucket when its gradients are ready);
* TP collectives (a group of ``totals.tensor_parallel`` ranks inside one node) are exposed:
  they sit between the matmuls that need them;
* the optimizer step and the collectives of the optimizer and "other" phases after the last
  reduction, exposed;
* gradient accumulation, ``micro_batches`` M: M forward/backward passes, gradient
  reductions (reduce-scatter, all-reduce) only in the last (``no_sync`` /
  ``set_requires_gradient_sync(False)``), one optimizer step;
* recomputation (activation checkpointing) is a phase of the trace: it costs its time inside
  the backward of its unit;
* a pipeline bubble when the record says the step is pipelined (``totals.pipeline``:
  ``stages`` p, ``micro_batches`` m, ``virtual_stages`` v, ``schedule``, and
  ``bubble_fraction`` when the audit computed it): that fraction, else (p-1)/(v m), of the
  compute for 1F1B/interleaved/GPipe, none for zero-bubble; else 0. A pipeline audit's
  composed stage (``totals.pipeline.per_stage``) holds one micro-step's ops and the step's
  totals and collectives (each row with ``micro_steps``, how many micro-steps issue it): its
  ops run m times, FSDP2's gathers in the first micro-step, reductions in the last, p2p and
  TP collectives (the step's rows) exposed (under te with virtual stages > 1 the p2p beside the
  chunks' compute: Megatron's ``overlap_p2p_comm``, exposed beyond it); its FLOPs and tokens
  are not multiplied again.

The result is ``predictions.step_time`` (docs/step-time.md, docs/record-format.md), with
``modules[].predicted_seconds`` (inclusive, compute only, x M) and
``collectives[].predicted_seconds`` (all calls of the row) filled in by :func:`attach_step_time`.

Known limitations: one rank's step stands for all (no stragglers, no data loading); compute
and communication kernels do not slow each other down when they overlap (SM and HBM
contention costs real runs ~5-10%); a fake step's CPU attention kernel is priced as the
kernel the part would run, not the one traced.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..formulas import steptime as st
from ..units import fmt_bytes, fmt_ms
from ..record import counts_samples
from ..record.steady import first_step_state

__all__ = ["predict_step_time", "attach_step_time", "op_seconds", "causal_mask_assumptions", "collective_row_seconds",
           "predict_into", "attention_kernels", "attention_assumption"]

_PHASES = ("forward", "backward", "recompute", "optimizer", "other")
#: Ops with which an optimizer makes its state on its first step (AdamW: exp_avg and
#: exp_avg_sq by zeros_like, the step count by torch.tensor -> lift_fresh): a first-step
#: record's optimizer phase is priced without them, as every later step runs.
STATE_CREATION = ("aten.zeros_like.", "aten.zeros.", "aten.full.", "aten.full_like.", "aten.lift_fresh.",
                  "aten.scalar_tensor.", "aten.ones_like.")
#: Ops that launch no kernel on a GPU (allocation, metadata, views the schema does not mark):
#: their recorded bytes are not traffic.
NO_KERNEL = ("aten.empty.", "aten.empty_like.", "aten.empty_strided.", "aten.new_empty.",
             "aten.new_empty_strided.", "aten._unsafe_view.", "aten.lift_fresh.", "aten.detach.",
             "aten.alias.", "aten._reshape_alias.", "aten.set_.", "aten.resize_.",
             "aten.is_same_size.", "aten._has_compatible_shallow_copy_type.")
_GATHER_OPS = ("all_gather",)
_KINDS = ("matmul", "attention", "memory_bound", "launch")
_REDUCE_OPS = ("reduce_scatter", "all_reduce")
_P2P_OPS = ("send", "recv")


def _dtype_of(rec) -> str:
    d = str(rec.meta.get("dtype") or "float32").replace("torch.", "")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(d, "fp32")


def _compiled(rec, opts) -> bool:
    return bool(opts.get("compiled")) or bool(rec.meta.get("compiled")) or _kernels(rec, opts) == "compiled"


def _kernels(rec, opts) -> str:
    """eager, compiled or te: ``options["kernels"]``, else the audit's ``--kernels``."""
    audit = rec.meta.get("audit") if isinstance(rec.meta.get("audit"), dict) else {}
    k = opts.get("kernels") or audit.get("kernels") or "eager"
    return k if k in ("eager", "compiled", "te") else "eager"


_BLOCK = re.compile(r"\.\d+(\.|$)")


def fp8_row(row: dict) -> tuple:
    """(row priced in fp8, bytes of its operand casts) for a matmul row of a transformer
    block's linear layer under ``--precision fp8`` (Transformer Engine runs the blocks'
    GEMMs in fp8 and keeps the embedding, the head and attention in 16 bits): each fp8 GEMM
    reads its two operands in bf16 and writes them in fp8 first (2 + 1 B an element: TE's
    cast-with-amax kernels), the GEMM itself at the part's dense fp8 peak."""
    module = str(row.get("module") or "")
    if row.get("kind") != "matmul" or not _BLOCK.search(module):
        return row, 0.0
    shapes, casts = [], 0.0
    for sh in row.get("shapes") or ():
        if "mnk" in sh and sh.get("dtype") in ("bf16", "fp16"):
            b, m, n, k = sh["mnk"]
            casts += 3.0 * int(sh.get("count") or 0) * b * (m * k + k * n)
            sh = dict(sh, dtype="fp8")
        shapes.append(sh)
    return dict(row, shapes=shapes), casts


def op_seconds(row: dict, gpu, eff: dict, default_dtype: str = "fp32", compiled: bool = False,
               cp: int = 1) -> dict:
    """``{"seconds", "kind", "launch", "flops_rate"}`` of one ``record.ops`` row (all its calls):
    kind is ``matmul``, ``attention``, ``memory_bound`` or ``free``; ``launch`` is the part of
    the seconds that is launch floor above the kernels' own time.

    Attention with an explicit mask the tracer took for the causal one (``mask_causal``: a
    causal LM traced on fake tensors, where transformers builds the mask it skips on a GPU
    with an all-ones padding mask, calling SDPA with ``is_causal=True``) is priced causal.

    ``cp``: the context-parallel degree of the step. A rank's T/cp queries over the
    all-gathered T keys (``sq x cp == sk``) ran under the kernel's causal flag (the standard
    plan's attention; records made before it used a shifted mask, a masked kernel computing
    every pair); on the GPU PyTorch's ``context_parallel`` and Transformer Engine run it as a
    load-balanced causal ring, each rank half the pairs: priced causal."""
    kind = row.get("kind")
    count = int(row.get("count") or 0)
    if count <= 0:
        return {"seconds": 0.0, "kind": "free", "launch": 0.0}
    launch = float(eff["launch_s"])
    name = str(row.get("op", ""))
    if kind in ("matmul", "attention"):
        total = floor_extra = 0.0
        priced = 0
        for s in row.get("shapes") or ():
            c = int(s.get("count") or 0)
            dt = s.get("dtype") or default_dtype
            if "mnk" in s:
                b, m, n, k = s["mnk"]
                raw = max(st.matmul_fraction(m, n, k, b, dt, gpu, eff)[0],
                          st.memory_seconds(st.DTYPE_BYTES.get(dt, 4) * b * (m * k + k * n + m * n), gpu, eff,
                                            floor=False))
                t = max(raw, launch)
            elif "attn" in s:
                b, h, sq, sk, d, dv = s["attn"]
                backward = "backward" in name
                causal = bool(s.get("causal") or s.get("mask_causal")) or (cp > 1 and sq * cp == sk)
                t = st.attention_seconds(b, h, sq, sk, d, dv, causal, backward, dt, gpu, eff=eff)
                raw = t
            else:
                continue
            total += c * t
            floor_extra += c * max(0.0, t - raw)
            priced += c
        rest = count - priced
        if rest > 0:         # no signature: from the row's FLOPs and bytes
            share = rest / count
            kernel = row_kernel(row, gpu, eff, default_dtype) if kind == "attention" else None
            fused = kind == "attention" and kernel != "math"     # a fused causal kernel skips half
            flops = float((row.get("flops_causal") if fused else row.get("flops")) or 0) * share
            nbytes = float((row.get("bytes_read") or 0) + (row.get("bytes_written") or 0)) * share
            if kind == "attention":
                if kernel == "math":               # bmm-bound, every pair: a matmul's rate
                    rate = st.attention_peak(gpu, default_dtype, kernel, eff) * float(eff["matmul_peak_fraction"])
                else:                              # the model count (2x forward) at the kernel's rate
                    fwd, bwd = eff["attention"].get(kernel, eff["attention"]["flash"])
                    back = "backward" in name or row.get("phase") == "backward"
                    rate = st.attention_peak(gpu, default_dtype, kernel, eff) * (bwd if back else fwd)
            else:
                cube = (flops / rest / 2) ** (1 / 3) if flops > 0 else 1
                c = max(int(cube), 1)
                rate = 2.0 * c ** 3 / max(st.matmul_fraction(c, c, c, 1, default_dtype, gpu, eff)[0], 1e-30)
            raw = max(flops / rate if rate else 0.0, st.memory_seconds(nbytes, gpu, eff, floor=False))
            t = max(raw, rest * launch)
            total += t
            floor_extra += t - raw
        return {"seconds": total, "kind": kind, "launch": floor_extra}
    if name.startswith(NO_KERNEL):
        return {"seconds": 0.0, "kind": "free", "launch": 0.0}
    nbytes = float((row.get("bytes_read") or 0) + (row.get("bytes_written") or 0))
    if compiled:            # chains fused: a row holds its chain's ends, the rest is inside
        nbytes, kernels = float(row.get("fused_bytes") or 0), int(row.get("fused_kernels") or 0)
    else:
        kernels = count if nbytes else 0
    if not kernels and not nbytes:
        return {"seconds": 0.0, "kind": "free", "launch": 0.0}
    raw = st.memory_seconds(nbytes, gpu, eff, floor=False)
    t = max(raw, kernels * launch)
    return {"seconds": t, "kind": "memory_bound", "launch": t - raw}


def causal_mask_assumptions(ops) -> list:
    """The assumptions line for attention whose explicit mask :func:`op_seconds` priced
    causal (``mask_causal`` in a shape), with the bytes of those masks the forward calls took
    (kept for backward by the CPU kernel, and counted so in the traced memory); else []."""
    why, nbytes = set(), 0
    for row in ops or ():
        for s in row.get("shapes") or ():
            if s.get("mask_causal"):
                why.add(str(s["mask_causal"]))
                if row.get("phase") == "forward":
                    nbytes += int(s.get("mask_bytes") or 0) * int(s.get("count") or 0)
    if not why:
        return []
    return [f"the explicit mask of a causal LM ({'; '.join(sorted(why))}) priced causal, as transformers runs "
            f"SDPA on a GPU with an all-ones padding mask (is_causal=True, no mask); fake tensors hold no "
            f"values: a padded batch would run the mask, dense. The traced memory counts up to "
            f"{fmt_bytes(nbytes)} of those masks, which that run would not build"]


MATH_PATH = "(attention, SDPA math path)"    # the tracer's name for the math path's bmm rows


def row_kernel(row: dict, gpu, eff: dict, default_dtype: str = "fp32") -> str:
    """The kernel an attention row without shapes is priced as: the math path where the traced
    device ran it (its bmm rows: every fused kernel refused the call there, 3-D inputs for one,
    and a GPU refuses them too), else SDPA's choice for the step's dtype."""
    if MATH_PATH in str(row.get("op", "")):
        return "math"
    return st.sdpa_kernel(default_dtype, gpu, eff)


def attention_kernels(ops, gpu, eff: dict, default_dtype: str = "fp32") -> dict:
    """{dtype: kernel} that :func:`op_seconds` prices the step's attention calls as: SDPA's
    choice for their input dtype on ``gpu`` (:func:`~torchledger.formulas.steptime.sdpa_kernel`:
    flash for 16-bit, memory-efficient or math for fp32)."""
    out: dict = {}
    for row in ops or ():
        if row.get("kind") != "attention":
            continue
        shapes = [s for s in row.get("shapes") or () if "attn" in s]
        for s in shapes:
            dt = s.get("dtype") or default_dtype
            kernel = st.sdpa_kernel(dt, gpu, eff, s["attn"][4], s["attn"][5])
            if out.get(dt) != "math":                  # a math call among fused ones: say so
                out[dt] = kernel
        if not shapes:
            kernel = row_kernel(row, gpu, eff, default_dtype)
            if out.get(default_dtype) != "math":
                out[default_dtype] = kernel
    return out


def attention_assumption(ops, gpu, eff: dict, default_dtype: str = "fp32") -> str:
    """The assumptions line for attention: the kernel each input dtype is priced as and why
    (:data:`~torchledger.formulas.steptime.SDPA_KERNEL_WHY`), whatever the traced device ran."""
    kernels = attention_kernels(ops, gpu, eff, default_dtype)
    if not kernels:
        return (f"attention (none in the step) would run as {eff['attention_kernel']} on {gpu.name} for "
                f"16-bit inputs")
    parts = []
    traced_math = any(MATH_PATH in str(r.get("op", "")) for r in ops or ())
    for dt in sorted(kernels):
        kernel = kernels[dt]
        if kernel == "math" and traced_math:
            why = st.SDPA_KERNEL_WHY["traced math"]
        elif dt in ("bf16", "fp16", "fp8"):
            why = st.SDPA_KERNEL_WHY["16-bit"]
        else:
            why = st.SDPA_KERNEL_WHY.get(kernel) if not eff.get("attention_kernel_fp32") else None
            why = why or "the part's own fp32 kernel, its attention_kernel_fp32"
        name = {"efficient": "memory-efficient", "math": "the math path"}.get(kernel, kernel)
        parts.append(f"{dt} attention as {name} on {gpu.name} ({why})")
    return " and ".join(parts) + ", whatever kernel the traced device ran"


def collective_row_seconds(row: dict, gpu, eff: dict) -> tuple:
    """``(seconds for all calls of the row, algorithm)``."""
    count = max(int(row.get("count") or 1), 1)
    size = float(row.get("algo_bytes") or row.get("bytes") or 0) / count
    t, algo = st.collective_seconds(row.get("op", ""), size, int(row.get("group_size") or 1),
                                    row.get("group_span"), gpu, eff)
    return t * count, algo


def _ancestors(name: str):
    yield name
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        yield name


def _unit_of(name, units) -> str | None:
    for a in _ancestors(name or ""):
        if a in units:
            return a
    return None


def predict_step_time(rec, gpu, options=None) -> dict:
    """The ``predictions.step_time`` dict of ``rec`` on ``gpu`` (a name or ``GPUSpec``).

    ``options``: ``compiled`` (fuse elementwise chains), ``micro_batches`` (M, default the
    record's ``totals.micro_batches`` or 1). Also returns, under private keys ``_modules``
    and ``_collectives``, the per-module and per-collective-row seconds (see
    :func:`attach_step_time`).

    In order: the step's kernels and layout (:func:`_pricing`), every op row priced
    (:func:`_price_ops`), every collective placed on the schedule (:func:`_place_collectives`),
    the micro-steps' overlap (:func:`_passes`), the pipeline bubble (:func:`_bubble`), the
    contention of compute under collectives, then the rates and the summary."""
    from ..formulas.hardware import get_gpu      # the hardware table reads its override file on first use
    ctx = _pricing(rec, get_gpu(gpu), options or {})
    micro = ctx["micro"]
    comp = _price_ops(rec, ctx)
    comm = _place_collectives(rec, ctx)
    # TP collectives: exposed in eager PyTorch; under te the sequence-parallel all-gathers and
    # reduce-scatters overlap the GEMMs they feed (Transformer Engine's userbuffers split them
    # into chunks that run under the neighbouring GEMM's chunks; it overlaps no all-reduce, so
    # TP without sequence parallelism stays exposed): exposed only beyond the matmul time
    serial = comm.serial + max(0.0, comm.tp_serial - micro * comp.kinds["matmul"])
    fwd_total, bwd_total, after_total = comp.group_total("forward"), comp.group_total("backward"), comp.after_total()
    passes_compute = micro * (fwd_total + bwd_total)
    # an interleaved te pipeline's sends and receives (Megatron-Core's overlap_p2p_comm, which
    # NeMo / Megatron-Bridge turn on whenever virtual stages > 1): each is issued
    # asynchronously beside the chunk it feeds or follows: exposed only beyond the passes'
    # compute. Without interleaving Megatron batches them and waits (batch_p2p_comm): exposed
    serial += max(0.0, comm.p2p_overlapped - passes_compute)
    if ctx["composed"]:
        comm_step = comm.total
    else:
        comm_step = micro * (comm.total - comm.reduced_once - comm.after) + comm.reduced_once + comm.after
    passes = _passes(comp, comm, micro)
    compute_step = passes_compute + after_total
    seconds = passes + serial + after_total + comm.after
    bubble, assumptions = _bubble(ctx, passes_compute)
    seconds += bubble
    exposed = max(0.0, seconds - compute_step - bubble)
    # compute under collectives in flight runs slower (NCCL's CTAs and copies take SMs and HBM)
    hidden = max(0.0, comm_step - exposed)
    contention = float(ctx["eff"].get("overlap_slowdown", 0.0)) * min(hidden, compute_step)
    seconds += contention
    out = _summary(rec, ctx, comp, seconds, {"comm_exposed": exposed, "comm_contention": contention,
                                              "bubble": bubble}, comm_step)
    out["assumptions"] = assumptions + _assumptions(rec, ctx, comp)
    out["bound"] = _bound(out, comm.rows, comm.seconds)
    out["_modules"] = {k: v * micro for k, v in comp.mod_seconds.items()}
    out["_collectives"] = comm.seconds
    return out


def _pricing(rec, gpu, opts: dict) -> dict:
    """The step's kernels, precision and layout as priced: what :func:`_price_row` reads for
    every op (gpu, eff, dtype, cp, fp8, te, compiled, zero1) and what the schedule reads
    (the pipeline, whether the record is a composed stage, the micro-batches)."""
    eff = st.efficiency(gpu)
    kernels = _kernels(rec, opts)
    compiled = _compiled(rec, opts) or kernels == "te"      # TE's fused norm/activation/bias/RoPE
    fusion_known = any("fused_kernels" in r for r in rec.ops or ())
    t = rec.totals
    audit = rec.meta.get("audit") if isinstance(rec.meta.get("audit"), dict) else {}
    te = kernels == "te"
    if te and "cudnn" in eff["attention"]:
        eff = dict(eff, attention_kernel="cudnn")          # TE's cuDNN fused attention
    # fp8 GEMMs where the part has fp8 tensor cores (Hopper, Blackwell); elsewhere they run 16-bit
    fp8_asked = audit.get("precision") == "fp8"
    # Megatron's distributed optimizer (ZeRO-1) under te: each data-parallel replica updates
    # 1/d of the parameters (its shard of the fp32 masters and moments). A step traced with it
    # (``optimizer.shards``: the standard plan's) already ran 1/d of the update; an older
    # record's full update is divided here
    shards = int(rec.optimizer.get("shards") or 1) if isinstance(rec.optimizer, dict) else 1
    zero1 = shards if shards > 1 else (
        max(int((t.get("parallel_dims") or {}).get("dp_replicate") or 1), 1) if te else 1)
    pipe = t.get("pipeline") if isinstance(t.get("pipeline"), dict) else None
    # a pipeline audit's composed stage (``per_stage``): its ops are one micro-step's, its
    # totals and collectives the whole step's (m micro-steps, each row with ``micro_steps``)
    composed = pipe is not None and isinstance(pipe.get("per_stage"), list) and bool(pipe.get("micro_batches"))
    if composed:
        micro = max(int(pipe["micro_batches"]), 1)
    else:
        micro = int(opts.get("micro_batches") or t.get("micro_batches") or audit.get("micro_batches") or 1)
    return {"gpu": gpu, "eff": eff, "dtype": _dtype_of(rec), "cp": _cp_of(t),
            "fp8": fp8_asked and bool(gpu.peak_flops.get("fp8")), "fp8_asked": fp8_asked, "te": te,
            "kernels": kernels, "compiled": compiled and fusion_known, "fusion_known": fusion_known,
            "unfusable": compiled and not fusion_known, "zero1": zero1, "zero1_traced": shards > 1, "pipe": pipe, "composed": composed,
            "micro": micro, "p2p_overlap": te and pipe is not None and int(pipe.get("virtual_stages") or 1) > 1}


@dataclass
class _Compute:
    """The step's op rows priced: seconds by phase and kind (forward/backward/recompute kinds
    per micro-batch, the optimizer's and "other" once), per module and per schedule unit."""

    by_phase: dict = field(default_factory=lambda: {p: 0.0 for p in _PHASES})
    kinds: dict = field(default_factory=lambda: dict.fromkeys(_KINDS, 0.0))
    kinds_once: dict = field(default_factory=lambda: dict.fromkeys(_KINDS, 0.0))
    fusable: float = 0.0         # what --compiled's fusion saves: all of it, and its launch part
    fusable_launch: float = 0.0
    mm_flops: float = 0.0
    mm_seconds: float = 0.0
    mod_seconds: dict = field(default_factory=dict)
    unit_compute: dict = field(default_factory=dict)     # (phase group, module) -> seconds
    dtype_flops: dict = field(default_factory=dict)
    skipped: int = 0

    def group_total(self, group: str) -> float:
        return sum(s for (g, _), s in self.unit_compute.items() if g == group)

    def after_total(self) -> float:
        return sum(s for (g, _), s in self.unit_compute.items() if g not in ("forward", "backward"))


def _price_ops(rec, ctx: dict) -> _Compute:
    """Every op row of ``rec`` priced (:func:`_price_row`) and tallied (:func:`_tally`); a
    first step's optimizer-state creation skipped, as every later step runs."""
    comp = _Compute()
    made_state = first_step_state(rec) > 0
    for row in rec.ops or ():
        if made_state and row.get("phase") == "optimizer" and str(row.get("op", "")).startswith(STATE_CREATION):
            comp.skipped += int(row.get("count") or 0)       # a steady step's optimizer has its state
            continue
        phase = row.get("phase") or "other"
        row, got, fuse, cast_s = _price_row(row, phase, ctx)
        if got["seconds"] + cast_s:
            _tally(comp, row, phase, got, fuse, cast_s, ctx)
    return comp


def _tally(comp: _Compute, row, phase: str, got: dict, fuse: bool, cast_s: float, ctx: dict) -> None:
    """Add one priced op row to the step's tallies."""
    secs = got["seconds"] + cast_s
    comp.by_phase[phase if phase in comp.by_phase else "other"] += secs
    bucket = comp.kinds if phase in ("forward", "backward", "recompute") else comp.kinds_once
    bucket["launch"] += got["launch"]
    body = got["seconds"] - got["launch"]
    if got["kind"] in bucket:
        bucket[got["kind"]] += body
    bucket["memory_bound"] += cast_s
    if got["kind"] == "memory_bound" and not fuse and ctx["fusion_known"] and phase != "optimizer":
        fused = op_seconds(row, ctx["gpu"], ctx["eff"], ctx["dtype"], True, ctx["cp"])
        times = ctx["micro"] if bucket is comp.kinds else 1
        comp.fusable += (got["seconds"] - fused["seconds"]) * times
        comp.fusable_launch += (got["launch"] - fused["launch"]) * times
    if got["kind"] == "matmul":
        comp.mm_flops += float(row.get("flops") or 0)
        comp.mm_seconds += body
        for s in row.get("shapes") or ():
            comp.dtype_flops[s.get("dtype")] = comp.dtype_flops.get(s.get("dtype"), 0) + s.get("flops", 0)
    module = row.get("module")
    if module is not None and module != "(no module)":
        for a in _ancestors(module):
            comp.mod_seconds[a] = comp.mod_seconds.get(a, 0.0) + secs
    group = "forward" if phase == "forward" else "backward" if phase in ("backward", "recompute") else phase
    key = (group, module if module not in (None, "(no module)") else "")
    comp.unit_compute[key] = comp.unit_compute.get(key, 0.0) + secs


@dataclass
class _Comm:
    """The step's collectives priced and placed: exposed serially, gathered before a unit
    (every micro-step or the first), reduced after one (the last micro-step or every one),
    spread over the backward (DDP's buckets), or after the passes."""

    rows: list
    seconds: list                # (seconds, algorithm) per row
    total: float
    units: set                   # the FSDP units (modules whose forward all-gathers)
    order: dict                  # module name -> its place in the record
    serial: float = 0.0          # exposed in forward/backward (TP, p2p, the rest), per step
    after: float = 0.0           # optimizer / other phases: after the last reduction, once
    pre: dict = field(default_factory=lambda: {"every": {"forward": {}, "backward": {}},
                                               "first": {"forward": {}, "backward": {}}})
    post: dict = field(default_factory=dict)         # unit -> its reductions in the last micro-step
    post_every: dict = field(default_factory=dict)   # unit -> its reductions in every micro-step
    spread: list = field(default_factory=list)       # backward reductions with no unit (DDP buckets)
    tail: float = 0.0            # reductions of the root / no unit: after the last block
    reduced_once: float = 0.0    # reductions (last micro-step only) of a one-micro-step record
    tp_serial: float = 0.0       # tensor-parallel collectives of the step (under te)
    p2p_overlapped: float = 0.0  # pipeline sends/receives of an interleaved te step (overlap_p2p_comm)


def _place_collectives(rec, ctx: dict) -> _Comm:
    """Every collective row priced and placed on the schedule.

    Each row runs in every micro-step ("every": its seconds split evenly over them), in the
    first only (FSDP2's gathers a pipeline stage keeps until the last micro-batch) or in the
    last only (gradient reductions: no_sync / set_requires_gradient_sync(False) before it).
    A record of one micro-step (gradient accumulation): its rows are one micro-step's, the
    reductions the last's. A composed pipeline stage: its rows are the step's."""
    gpu, eff = ctx["gpu"], ctx["eff"]
    rows = [c for c in (rec.collectives or []) if isinstance(c, dict)]
    priced = [collective_row_seconds(c, gpu, eff) for c in rows]
    units = {(c.get("module") if c.get("module") not in (None, "(no module)") else "")
             for c in rows if c.get("op") in _GATHER_OPS and c.get("phase") == "forward"}
    comm = _Comm(rows=rows, seconds=priced, total=sum(s for s, _ in priced), units=units,
                 order={m.get("name"): i for i, m in enumerate(rec.modules or ())})
    tp = int(rec.totals.get("tensor_parallel") or 1)
    for c, (secs, _) in zip(rows, priced):
        _place(comm, c, secs, tp, ctx)
    return comm


def _place(comm: _Comm, c: dict, secs: float, tp: int, ctx: dict) -> None:
    """Place one collective row (see :func:`_place_collectives`)."""
    micro, composed = ctx["micro"], ctx["composed"]
    phase, op = c.get("phase"), c.get("op")
    r, nodes = st.group_layout(int(c.get("group_size") or 1), c.get("group_span"), ctx["gpu"].gpus_per_node or 8)
    is_tp = tp > 1 and int(c.get("group_size") or 1) == tp and nodes == 1
    group = "forward" if phase == "forward" else "backward" if phase in ("backward", "recompute") else "after"
    module = c.get("module") if c.get("module") not in (None, "(no module)") else ""
    unit = _unit_of(module, comm.units) if comm.units else None
    if composed:
        steps = int(c.get("micro_steps") or (micro if op in ("send", "recv") or is_tp else 1))
        every = steps >= micro
        per_micro = secs / micro if every else secs
    else:
        every, per_micro = True, secs
    exposed = secs if composed else micro * secs        # a serial collective's time in the step
    if group == "after":
        comm.after += secs
    elif is_tp and ctx["te"] and op in ("all_gather", "reduce_scatter"):
        comm.tp_serial += exposed
    elif op in _P2P_OPS and ctx["p2p_overlap"]:
        comm.p2p_overlapped += exposed
    elif is_tp:
        comm.serial += exposed
    elif op in _GATHER_OPS and unit is not None:
        where = comm.pre["every" if every else "first"][group]
        where[unit] = where.get(unit, 0.0) + per_micro
    elif op in _REDUCE_OPS and group == "backward":
        comm.reduced_once += 0.0 if composed else secs
        if composed and every and unit is not None and unit != "":
            comm.post_every[unit] = comm.post_every.get(unit, 0.0) + per_micro
        elif unit is not None and unit != "":
            comm.post[unit] = comm.post.get(unit, 0.0) + secs
        elif comm.units:
            comm.tail += secs
        else:
            comm.spread.append(secs)
    else:
        comm.serial += exposed


def _passes(comp: _Compute, comm: _Comm, micro: int) -> float:
    """The forward and backward passes of the step's micro-steps with their gathers and
    reductions overlapped unit by unit (``formulas.steptime.overlap_timeline``): the first
    micro-step gathers what the others keep, the last reduces."""
    units = comm.units
    ordered = sorted((u for u in units if u != ""), key=lambda u: comm.order.get(u, 1 << 30))
    fwd_total, bwd_total = comp.group_total("forward"), comp.group_total("backward")

    def unit_time(group, unit):
        """Compute of ``unit`` in ``group`` without the units nested in it."""
        return sum(s for (g, m), s in comp.unit_compute.items() if g == group and _unit_of(m, units) == unit)

    f_comp = {u: unit_time("forward", u) for u in ordered}
    b_comp = {u: unit_time("backward", u) for u in ordered}

    def gather(group, u, first):
        g = comm.pre["every"][group].get(u, 0.0)
        return g + (comm.pre["first"][group].get(u, 0.0) if first else 0.0)

    def micro_step(first: bool, last: bool) -> float:
        if units:
            f_units = [(gather("forward", "", first), 0.0, 0.0)] if "" in units else []
            f_units += [(gather("forward", u, first), f_comp[u], 0.0) for u in ordered]
            fwd = st.overlap_timeline(f_units, tail_compute=fwd_total - sum(c for _, c, _ in f_units))
            b_units = [(gather("backward", u, first), b_comp[u],
                        comm.post_every.get(u, 0.0) + (comm.post.get(u, 0.0) if last else 0.0))
                       for u in reversed(ordered)]
            b_rest = bwd_total - sum(c for _, c, _ in b_units)
            tail = [(0.0, 0.0, comm.tail)] if comm.tail and last else []
            bwd = st.overlap_timeline(b_units + tail, head_compute=b_rest)
        else:
            fwd = st.overlap_timeline([], head_compute=fwd_total)
            if comm.spread and last:
                bwd = st.overlap_timeline([(0.0, bwd_total / len(comm.spread), s) for s in comm.spread])
            else:
                bwd = st.overlap_timeline([], head_compute=bwd_total)
        return fwd["seconds"] + bwd["seconds"]

    if micro > 1:
        return micro_step(True, False) + (micro - 2) * micro_step(False, False) + micro_step(False, True)
    return micro_step(True, True)


def _bubble(ctx: dict, passes_compute: float) -> tuple:
    """``(seconds, assumptions)`` of the pipeline bubble: the record's own bubble fraction (the
    schedule's, from the layouts) or (p-1)/(v m), of the passes' compute."""
    pipe, micro = ctx["pipe"], ctx["micro"]
    if pipe is None or int(pipe.get("stages") or pipe.get("pp") or 1) <= 1:
        return 0.0, []
    p = int(pipe.get("stages") or pipe.get("pp"))
    m = max(int(pipe.get("micro_batches") or micro), 1)
    v = max(int(pipe.get("virtual_stages") or 1), 1)
    sched = str(pipe.get("schedule") or "1f1b")
    frac = 0.0 if "zero" in sched else (p - 1) / (v * m)
    if isinstance(pipe.get("bubble_fraction"), (int, float)):   # the layouts issue's own figure
        frac = float(pipe["bubble_fraction"])
    assumptions = [f"pipeline {p} stages, {m} micro-batches, {sched}: bubble (p-1)/(v m) = {frac:.3f} "
                   f"of the compute"]
    if ctx["composed"]:
        p2p = ("p2p overlapped with the chunks' compute (Megatron's overlap_p2p_comm of interleaved "
               "schedules: exposed beyond it)" if ctx["p2p_overlap"] else "p2p exposed")
        assumptions.append(f"the bounding stage's step: {m} micro-steps of its traced one, FSDP2's gathers in "
                           f"the first, gradient reductions in the last, {p2p}, TP collectives as above")
    return frac * passes_compute, assumptions


def _summary(rec, ctx: dict, comp: _Compute, seconds: float, extra: dict, comm_step: float) -> dict:
    """The prediction's figures: rates (tokens/s/GPU, MFU, HFU against the peak of the dtype
    the matmuls ran in), time by phase and kind."""
    t, micro, gpu, eff = rec.totals, ctx["micro"], ctx["gpu"], ctx["eff"]
    per_step = 1 if ctx["composed"] else micro      # a composed stage's totals are its step's already
    flops = float((t.get("flops") or {}).get("total") or 0) * per_step
    hflops = float(t.get("hardware_flops") or 0) * per_step
    peak = st.dense_peak(gpu, _matmul_dtype(comp, ctx), eff)
    tokens = (t.get("tokens") or 0) * per_step
    # the step's global tokens / seconds / world size: a rank's tokens are its data-parallel
    # shard's (T/cp of each sequence under cp), which tp x pp ranks process together
    tok_rate = tokens / seconds / _model_parallel(t) if tokens and seconds and not counts_samples(t) else None
    by_kind = {k: v * micro + comp.kinds_once[k] for k, v in comp.kinds.items()}
    by_kind.update(extra)
    phases = {p: v * (micro if p in ("forward", "backward", "recompute") else 1) for p, v in comp.by_phase.items()}
    if not phases.get("other"):
        phases.pop("other", None)
    return {
        "gpu": gpu.name, "seconds": seconds, "micro_batches": micro,
        "tokens_per_s_per_gpu": tok_rate, "mfu": flops / seconds / peak if seconds and flops else None,
        "hfu": hflops / seconds / peak if seconds and hflops else None,
        "by_phase": phases, "by_kind": by_kind,
        "comm_seconds": comm_step, "comm_exposed_seconds": extra["comm_exposed"], "bubble_seconds": extra["bubble"],
        "matmul_fraction_of_peak": comp.mm_flops / comp.mm_seconds / peak if comp.mm_seconds else None,
        "compiled": ctx["compiled"], "fusable_seconds": comp.fusable,
        "fusable_launch_seconds": max(0.0, min(comp.fusable_launch, comp.fusable)),
    }


def _matmul_dtype(comp: _Compute, ctx: dict) -> str:
    """The dtype most of the matmul FLOPs ran in (the record's dtype without matmul shapes)."""
    return max(comp.dtype_flops, key=comp.dtype_flops.get) if comp.dtype_flops else ctx["dtype"]


def _assumptions(rec, ctx: dict, comp: _Compute) -> list:
    """What the prediction assumes, one line each: the part, the matmul dtypes, the attention
    kernel, the kernels, the collectives and their overlap, and the run's particulars."""
    gpu, eff, dtype = ctx["gpu"], ctx["eff"], ctx["dtype"]
    mdtype = _matmul_dtype(comp, ctx)
    peak = st.dense_peak(gpu, mdtype, eff)
    dtype_flops = comp.dtype_flops
    out = [
        f"{gpu.name}: dense {mdtype} peak {peak / 1e12:,.1f} TFLOP/s, HBM {gpu.bandwidth_bytes_per_s / 1e12:.2f} TB/s "
        f"at {eff['memory_fraction']:.0%}, {eff['launch_s'] * 1e6:.0f} us launch floor per kernel",
        f"matmuls at the traced dtypes ({', '.join(sorted(k for k in dtype_flops if k)) or dtype}); "
        f"fp32 without TF32 (PyTorch's default)" if "fp32" in (dtype_flops or {dtype: 1}) else
        f"matmuls at the traced dtypes ({', '.join(sorted(k for k in dtype_flops if k))})",
        attention_assumption(rec.ops, gpu, eff, dtype),
        _kernels_line(ctx["kernels"], ctx["compiled"], ctx["zero1"], ctx["fp8"]),
        f"collectives: NCCL ring/tree alpha-beta, NVLink {eff['nvlink_fraction']:.0%} and NICs "
        f"{eff['network_fraction']:.0%} of peak, {gpu.gpus_per_node} GPUs and {gpu.nics_per_node} NICs per node, "
        f"ranks placed node by node",
        "FSDP all-gathers prefetched one unit ahead, reduce-scatters under the next backward; TP collectives "
        + ("of sequence parallelism overlapped with the GEMMs (exposed beyond the matmul time), "
           "all-reduces exposed" if ctx["te"] else "exposed")
        + "; the optimizer after the last reduction",
    ]
    return out + _particulars(rec, ctx, comp)


def _particulars(rec, ctx: dict, comp: _Compute) -> list:
    """The assumptions lines only some runs have (sustained factors, fusion, micro-batches,
    fp8 without fp8 tensor cores, the first step's optimizer state, cp, causal masks)."""
    eff, gpu, micro, cp = ctx["eff"], ctx["gpu"], ctx["micro"], ctx["cp"]
    out = []
    if eff.get("sustained_fraction", 1.0) != 1.0 or eff.get("overlap_slowdown"):
        out.append(f"sustained training: tensor-core work (GEMMs, attention) at "
                   f"{float(eff.get('sustained_fraction', 1.0)):.3f} of the single-kernel figures; "
                   f"compute under collectives in flight {float(eff.get('overlap_slowdown', 0.0)):.0%} "
                   f"slower (NCCL's CTAs and copies)")
    if ctx["unfusable"]:
        out.append("--compiled asked, but the record has no fusion chains (made before they were "
                   "recorded): priced unfused")
    if micro > 1:
        out.append(f"{micro} micro-batches: gradient reductions in the last only, one optimizer step")
    if ctx["fp8_asked"] and not ctx["fp8"]:
        out.append(f"--precision fp8: {gpu.name} has no fp8 tensor cores; the GEMMs priced in bf16, "
                   f"as Transformer Engine would have to run them there")
    if comp.skipped:
        out.append(f"a steady step: the traced first step's optimizer made its state ({comp.skipped} "
                   f"zero-fill and scalar kernels), which later steps do not; not priced")
    if cp > 1:
        out.append(f"context parallel {cp}: each rank's T/{cp} queries over the all-gathered keys as a "
                   f"load-balanced causal ring (half the pairs, as PyTorch's context_parallel and "
                   f"Transformer Engine run it)")
    return out + causal_mask_assumptions(rec.ops)


def _cp_of(totals) -> int:
    """The context-parallel degree of the record's layout."""
    return int((totals.get("parallel_dims") or {}).get("cp") or 1)


def _price_row(row, phase, p) -> tuple:
    """``(row as priced, op_seconds' dict, fused?, seconds of fp8 casts)`` of one op row under
    the step's kernels (``p``, built by :func:`predict_step_time`): fp8 for the blocks' GEMMs,
    model fusion (compiled, te) in the passes and TE's fused Adam in the optimizer, the
    distributed optimizer's 1/d of the step."""
    casts = 0.0
    if p["fp8"]:
        row, casts = fp8_row(row)
    fuse = p["compiled"] and (phase in ("forward", "backward", "recompute") or (p["te"] and phase == "optimizer"))
    got = op_seconds(row, p["gpu"], p["eff"], p["dtype"], fuse, p["cp"])
    if phase == "optimizer" and p["zero1"] > 1 and not p["zero1_traced"]:
        got = {k: (v / p["zero1"] if isinstance(v, float) else v) for k, v in got.items()}
    cast_s = st.memory_seconds(casts, p["gpu"], p["eff"], floor=False) if casts else 0.0
    return row, got, fuse, cast_s


def _kernels_line(kernels: str, fused: bool, zero1: int, fp8: bool) -> str:
    """The assumptions line that says which kernels the step is priced as."""
    if kernels == "te":
        line = ("kernels te (Megatron-Core / NeMo with Transformer Engine): cuDNN fused attention, fused "
                "norm/activation/bias/RoPE (elementwise chains one read and one write each), fused Adam")
        line += f", distributed optimizer (each of {zero1} replicas steps 1/{zero1})" if zero1 > 1 else ""
    elif fused:
        line = ("kernels compiled (torch.compile of the model): elementwise chains fused, one read and one "
                "write per chain; the optimizer step eager")
    else:
        line = "kernels eager: every elementwise op its own kernel (--kernels compiled or te fuse them)"
    if fp8:
        line += ("; fp8: the blocks' linear-layer GEMMs at the dense fp8 peak, their operands cast from bf16 "
                 "first (3 B an element); embedding, head and attention in bf16")
    return line


def _model_parallel(totals) -> int:
    """tp x pp of the record's layout: the ranks that share one data-parallel rank's tokens."""
    dims = totals.get("parallel_dims") if isinstance(totals.get("parallel_dims"), dict) else {}
    out = 1
    for name in ("tp", "pp"):
        try:
            out *= max(int(dims.get(name) or 1), 1)
        except (TypeError, ValueError):
            pass
    return out


def _pct(x, total) -> str:
    return f"{100 * x / total:.0f}%"


def _bound(p: dict, rows, coll) -> str:
    """One sentence: where the time goes, largest first."""
    T = p["seconds"]
    if not T:
        return "nothing to time: the step has no ops"
    k = p["by_kind"]
    parts = []
    mm = f"{_pct(k['matmul'], T)} matmul"
    if p.get("matmul_fraction_of_peak"):
        mm += f" at {p['matmul_fraction_of_peak']:.0%} of peak"
    items = [(k["matmul"], mm), (k["attention"], f"{_pct(k['attention'], T)} attention")]
    items.append((k["memory_bound"], f"{_pct(k['memory_bound'], T)} memory-bound elementwise"))
    if k["comm_exposed"]:
        ops = {}
        for c, (s, _) in zip(rows, coll):
            ops[c.get("op")] = ops.get(c.get("op"), 0) + s
        top = max(ops, key=ops.get).replace("_", "-") if ops else "communication"
        items.append((k["comm_exposed"], f"{_pct(k['comm_exposed'], T)} exposed communication (largest: {top})"))
    items.append((k["launch"], f"{_pct(k['launch'], T)} launch overhead"))
    if k.get("comm_contention"):
        items.append((k["comm_contention"], f"{_pct(k['comm_contention'], T)} compute slowed by overlapped "
                                            f"collectives"))
    if k["bubble"]:
        items.append((k["bubble"], f"{_pct(k['bubble'], T)} pipeline bubble"))
    items.sort(key=lambda x: -x[0])
    parts = [text for v, text in items if v > 0.005 * T]
    return (", ".join(parts) or "no dominant cost") + _fusable_text(p)


def _fusable_text(p: dict) -> str:
    """What fusing the elementwise chains (--compiled) saves, as a share of the whole step and
    split into its two parts, each of the step too: the chains' HBM traffic (the memory-bound
    time above) and their kernels' launches (in the launch overhead above). Records made before
    the split give the whole alone."""
    T, saved = p["seconds"], p.get("fusable_seconds") or 0.0
    if not saved or saved <= 0.005 * T:
        return ""
    text = f"; --compiled would save {_pct(saved, T)} of the step"
    launch = p.get("fusable_launch_seconds")
    if not isinstance(launch, (int, float)):
        return text + " (fusing the elementwise chains)"
    parts = [(saved - launch, "elementwise HBM traffic"), (launch, "kernel launches")]
    shown = [(v, name) for v, name in parts if v > 0.005 * T]
    if len(shown) == 1:
        return text + f", in {shown[0][1]}"
    return text + ", " + " and ".join(f"{_pct(v, T)} in {name}" for v, name in shown)


def attach_step_time(rec, gpu, options=None) -> dict:
    """Predict and store: ``rec.predictions["step_time"]``, ``modules[].predicted_seconds``
    and ``collectives[].predicted_seconds`` (and ``predicted_algorithm``). Returns the dict."""
    pred = predict_step_time(rec, gpu, options)
    mods = pred.pop("_modules")
    colls = pred.pop("_collectives")
    for m in rec.modules or ():
        m["predicted_seconds"] = mods.get(m.get("name"), 0.0)
    for c, (secs, algo) in zip([c for c in rec.collectives or [] if isinstance(c, dict)], colls):
        c["predicted_seconds"] = secs
        c["predicted_algorithm"] = algo
    measured = rec.totals.get("step_seconds")
    if measured and not str(rec.meta.get("device", "")).startswith(("fake", "meta", "cpu")):
        pred["measured_seconds"] = measured
        pred["predicted_over_measured"] = pred["seconds"] / measured
    rec.predictions["step_time"] = pred
    return pred


def predict_into(rec, gpu, options=None, stages=None) -> None:
    """:func:`attach_step_time` for a report: a failure becomes a record warning, never an
    exception (a record from an older torchledger, a part without figures).

    ``stages``: a pipeline audit's composed record of every distinct stage ({rank: record},
    ``rec`` the bounding, highest-memory, one among them): each is priced, and the step is
    the slowest stage's (every stage waits for it at each micro-batch); ``rec`` keeps its own
    modules' and collectives' seconds, ``predictions.step_time`` is the slowest stage's."""
    opts = options or {}
    kw = {"compiled": opts.get("compiled"), "micro_batches": opts.get("micro_batches")}
    try:
        attach_step_time(rec, gpu, kw)
        if stages:
            _price_every_stage(rec, stages, gpu, kw)
    except Exception as e:  # noqa: BLE001
        rec.warnings.append(f"predicted step time unavailable: {type(e).__name__}: {e}")


def _price_every_stage(rec, stages: dict, gpu, kw: dict) -> None:
    """The step time of the slowest of ``stages`` into ``rec`` (see :func:`predict_into`)."""
    own = rec.predictions["step_time"]
    pipe = rec.totals.get("pipeline") if isinstance(rec.totals.get("pipeline"), dict) else {}
    bounding = pipe.get("bounding_rank")
    seconds = {}
    preds = {}
    for r, stage in stages.items():
        preds[r] = own if stage is rec else predict_step_time(stage, gpu, kw)
        seconds[r] = preds[r]["seconds"]
    for row in pipe.get("per_stage") or ():
        if row.get("rank") in seconds:
            row["predicted_seconds"] = seconds[row["rank"]]
    slowest = max(seconds, key=lambda r: (seconds[r], r == bounding))
    if slowest == bounding or preds[slowest] is own:
        own["assumptions"].append(f"pipeline: every distinct stage priced; the step is the slowest's, rank "
                                  f"{slowest} ({fmt_ms(seconds[slowest])}), the bounding (highest-memory) stage")
        return
    pred = {k: v for k, v in preds[slowest].items() if not k.startswith("_")}
    pred["assumptions"] = list(pred["assumptions"]) + [
        f"pipeline: every distinct stage priced; the step is the slowest's, rank {slowest} "
        f"({fmt_ms(seconds[slowest])}), not the bounding (highest-memory) rank {bounding} "
        f"({fmt_ms(seconds.get(bounding, own['seconds']))}) whose record this is"]
    for key in ("measured_seconds", "predicted_over_measured"):
        if key in own:
            pred[key] = own[key]
    rec.predictions["step_time"] = pred
