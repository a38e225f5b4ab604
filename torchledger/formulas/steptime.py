"""Time of one op, one collective and one overlapped step on a named part: pure arithmetic.

The step-time model of ``audit --gpu NAME`` (issue 23). Each function takes shapes and a
:class:`~torchledger.formulas.hardware.GPUSpec` and returns seconds; the analyzer
(:mod:`torchledger.steptime.predict`) applies them to a traced step's ops and collectives.

* **Matmul** (:func:`matmul_seconds`): the kernel is modelled as a tiled GEMM the way cuBLAS /
  CUTLASS run it. The output is cut into tiles (256x128, 128x256, 128x128, 64x128, 64x64:
  CUTLASS's default tile shapes), the tiles are spread over the SMs in *waves* (a wave is one
  tile per SM: 2,048 tiles on 132 SMs take 16 waves, the last one 52% full), and each tile
  runs a K loop of ``ceil(K / 64)`` iterations plus ``matmul_k_overhead`` iterations' worth of
  prologue (filling the software pipeline) and epilogue (writing the tile). Padding a skinny
  shape up to whole tiles, the empty part of the last wave and the fixed per-tile cost are
  what makes a small matmul slow; split-K (``K`` cut into slices that run as more tiles) is
  tried when there are fewer tiles than SMs, as cuBLAS's heuristics do. The kernel's best
  sustained fraction of the dense peak (``matmul_peak_fraction``: clocks under load, issue
  overheads) multiplies it all. The fastest tile choice wins (cuBLAS's heuristic picks the
  best kernel for a shape), then the memory roofline (operands read once, result written
  once, at ``memory_fraction`` of HBM bandwidth) and the launch floor.

  Hand check, H100 SXM bf16, 16384 x 4096 x 4096: tile 256x128 gives 64 x 32 = 2,048 tiles,
  16 waves of 132 (97.0% full), 64 + 2 K iterations (97.0%), x 0.78 (the part's sustained
  fraction) = 73.4% of peak (a 128x128 tile feeds 64 FLOP/B of the 85 Hopper needs: slower);
  128 x 128 x 128: one tile on one SM of 132, 2 + 2 K iterations: the 5 us launch floor,
  0.08% of peak.

* **Attention** (:func:`attention_seconds`): FLOPs the kernel executes (causal: half the
  dense score matrix, the masked blocks are skipped; backward: 2.5 x forward, the fused
  kernels recompute Q K^T) at the kernel's own fraction of peak (``attention`` table: flash,
  cuDNN, memory-efficient), scaled down for short sequences (``S / (S + attention_seq_half)``),
  head dims below 128 and causal kernels (``attention_causal_fraction``: the FA papers'
  causal kernels run ~13% slower per executed FLOP); the math path is priced as its matmuls
  and softmax instead. The kernel is SDPA's for the inputs' dtype (:func:`sdpa_kernel`, from
  PyTorch's sdp_utils.cpp): flash (cuDNN under TE) for 16-bit inputs, memory-efficient for
  fp32 (flash and cuDNN take 16-bit only; it runs 3xTF32, a third of the TF32 peak), the math
  path for fp32 head dims it cannot align.

* **Memory-bound** ops (:func:`memory_seconds`): bytes read + written over
  ``memory_fraction`` of the HBM bandwidth, never under the launch floor.

* **Collectives** (:func:`collective_seconds`): NCCL's own cost model (``src/graph/tuning.cc``):
  latency = base + per-step hardware latency x ring steps (intra-node steps at the NVLink
  figure, inter-node steps at the network one; tree: 2 x (intra + log2(nodes) x inter)), time
  = latency + bus bytes / bus bandwidth, with the ring or tree and LL or Simple protocol that
  is fastest for the size, as NCCL picks. Bus bandwidth: NVLink per GPU within a node; across
  nodes the NICs of a node shared by the groups that run at once: a group with ``r`` of its
  ranks in each node gets ``r / gpus_per_node`` of the node's NICs (8x8 mesh, TP inside nodes:
  each FSDP group has one rank per node, so one NIC, 50 GB/s on a DGX H100).

Every constant is in :data:`DEFAULT_EFFICIENCY` (or the part's ``efficiency`` row) with its
source; ``torchledger calibrate`` refits the kernel ones from measured records.

Known limitations:
  - no clock throttling under sustained load beyond ``matmul_peak_fraction``; no L2 reuse
    across kernels; no stream-K (cuBLAS on Hopper) beyond the split-K candidates;
  - NVLS only for a one-node all-reduce (not NVLS tree across nodes, nor IB SHARP); PXN and
    multi-rail topologies are not modelled;
  - the launch floor is per kernel: a step that CUDA graphs capture pays less.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional
from .hardware import HARDWARE_ENV

__all__ = ["DEFAULT_EFFICIENCY", "efficiency", "matmul_seconds", "matmul_fraction", "attention_seconds",
           "sdpa_kernel", "attention_peak", "SDPA_KERNEL_WHY", "memory_seconds", "collective_seconds", "group_layout", "bus_bandwidth", "peak_dtype", "dense_peak",
           "overlap_timeline", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

#: The model's parameters, each with where it comes from. A part's ``efficiency`` row (built
#: in, ``TORCHLEDGER_HARDWARE`` or ``torchledger calibrate``) overrides any of them.
DEFAULT_EFFICIENCY = {
    # Best sustained fraction of the dense peak a large GEMM reaches. cuBLAS on an H100 SXM
    # reaches ~750-800 TF/s bf16 of 989 at 8192^3 (NVIDIA's Hopper tuning guide and the
    # published cuBLAS/CUTLASS profiler figures: ~0.75-0.8); A100 ~270-290 of 312 (~0.87-0.9).
    "matmul_peak_fraction": 0.80,
    # Output tile shapes cuBLAS/CUTLASS choose between (CUTLASS default GEMM configurations).
    "matmul_tiles": [[256, 128], [128, 256], [128, 128], [64, 128], [64, 64]],
    # K elements per main-loop iteration (CUTLASS's 64-wide K tile for 16-bit types).
    "matmul_k_tile": 64,
    # Operand intensity (FLOPs per byte of A and B a tile loads, 2*tm*tn / ((tm+tn) x bytes))
    # a tile needs to keep the tensor cores busy; smaller tiles run at intensity / this. Ampere
    # reaches peak with 128x128 tiles (64 FLOP/B in 16-bit); Hopper needs 128x256 with warp
    # specialisation (85 FLOP/B: CUTLASS 3 Hopper GEMM defaults, the FA3/CUTLASS talks).
    "matmul_min_intensity": 85.0,
    # Prologue + epilogue per output tile, in K iterations: a 3-4 stage pipeline fills with
    # stages-1 loads before the first MMA, and the epilogue writes the tile (CUTLASS multistage).
    "matmul_k_overhead": 2.0,
    # Fraction of HBM bandwidth streaming kernels reach (STREAM-like copy/triad on A100/H100:
    # ~85-92% of the datasheet figure; elementwise PyTorch kernels a little less).
    "memory_fraction": 0.80,
    # Host cost per kernel in eager PyTorch: dispatcher + CUDA launch, ~4-10 us per op
    # (PyTorch performance tuning guide; cudaLaunchKernel alone ~2-4 us). A step of tiny ops
    # runs at this cadence.
    "launch_s": 5e-6,
    # The attention kernel SDPA picks for 16-bit inputs on this part, and each kernel's
    # fraction of dense peak at long sequences and head dim 128, [forward, backward].
    "attention_kernel": "flash",
    # The kernel for fp32 inputs; None: SDPA's CUDA rule (sdpa_kernel: memory-efficient, the
    # math path for head dims it cannot align). A part that is not a GPU (a host CPU, whose
    # flash kernel takes fp32) names its own.
    "attention_kernel_fp32": None,
    "attention": {
        # FlashAttention-2 paper (Dao 2023) Fig. 4-6: A100 fwd 70%, bwd ~60% of 312 TF/s.
        "flash": [0.65, 0.55],
        # cuDNN 9 fused attention (NVIDIA cuDNN release figures), close to FA2 on Ampere.
        "cudnn": [0.65, 0.55],
        # xFormers memory-efficient kernel: ~half FA2's speed (FA2 paper Fig. 4 baselines).
        "efficient": [0.35, 0.30],
    },
    # Sequence length at which attention reaches half its long-sequence fraction (the
    # FA2 paper's curves rise from ~0.5 at 512 to the plateau by 4-8k): efficiency x S/(S+s0).
    "attention_seq_half": 256,
    # A causal kernel's rate per executed FLOP over the dense kernel's at the same shape: the
    # diagonal blocks run masked and the blocks per query row are uneven. FA3 paper (Shah et
    # al. 2024) Fig. 5, H100 forward, head dim 128, causal over non-causal TFLOP/s (both
    # counting the FLOPs each executes): FlashAttention-2 (the kernel PyTorch's SDPA runs)
    # 191/309 = 0.62 at 512, 260/350 = 0.74 at 1k, 298/362 = 0.82 at 2k, 319/368 = 0.87 at
    # 4k, 333/370 = 0.90 at 8k, 335/370 = 0.91 at 16k; cuDNN 0.85 and FA3 0.91 at 4k. One
    # constant, FA2's figure at 4k, the middle of the 2k-8k that training runs use (8k-16k
    # lose ~10%, 1k 26%; not modelled by length), for every kernel, forward and backward.
    "attention_causal_fraction": 0.87,
    # NCCL-tests bus bandwidth reached as a fraction of the link peak (nccl-tests on DGX
    # A100/H100: all-reduce busbw ~230/~360-370 GB/s of 300/450 GB/s NVLink; IB ~90%).
    "nvlink_fraction": 0.80,
    "network_fraction": 0.90,
    # NVLink SHARP (NVLS): on NVSwitch systems with in-switch reduction (H100, H200, B200;
    # not A100's NVSwitch) NCCL >= 2.17 runs a one-node all-reduce in the switch: each GPU
    # sends and receives its buffer once. Its bus bandwidth as a fraction of the part's NVLink
    # one-way figure (nccl-tests on DGX H100: ~480 GB/s busbw against a ring's ~360: 480/450 =
    # 1.067); latency NCCL's tuning.cc NVLS figure, 25 us. 0: no NVLS on the part.
    "nvls_fraction": 0.0,
    # fp32 matmuls on tensor cores (TF32)? PyTorch's default is no
    # (torch.backends.cuda.matmul.allow_tf32 = False): fp32 matmuls at the fp32 peak.
    "allow_tf32": False,
    # -- sustained training (issue 29): what a whole step holds below single-kernel figures --
    # Tensor-core work (GEMMs, attention) in a training step runs below the kernel benchmarks
    # above: clocks under sustained power (a GEMM benchmark runs seconds on a cool part; a
    # step runs for hours at the power cap), L2 cold between kernels, the allocator and host
    # gaps. One global factor over every part's tensor-core time, the model's one fitted
    # parameter: fitted to the twelve published runs of benchmarks/data/calibration-runs.json
    # (benchmarks/predict_published.py --fit: 0.82; the fit without each run gave 0.82-0.83;
    # README gives each run's in-sample and leave-one-out error).
    "sustained_fraction": 0.82,
    # Compute that runs while a collective is in flight slows down: NCCL runs one CTA per
    # channel on SMs the GEMMs then lack (NCCL_MAX_CTAS defaults to 32: up to a quarter of
    # an A100's 108 SMs; 16 channels, NCCL's usual count on NVLink and IB, are 15% of them)
    # and its copies take HBM bandwidth: the fraction of the overlapped time added to the
    # compute, 0.15 from that share. Not fitted: fitted beside sustained_fraction, the fits
    # without each published run scattered it over 0 to 0.30 (the runs do not pin it).
    "overlap_slowdown": 0.15,
}

#: Per-part defaults that differ from :data:`DEFAULT_EFFICIENCY` (merged under the part's own
#: ``efficiency`` row). Keyed by ``GPUSpec.name``.
PART_EFFICIENCY = {
    # A100: cuBLAS bf16 ~280 TF/s of 312 at large sizes (NVIDIA A100 tuning guide / Deep
    # Learning Performance docs: "up to 90%"); 128x128 is its largest common CUTLASS tile.
    "A100 SXM": {"matmul_peak_fraction": 0.88, "matmul_min_intensity": 64.0},
    "A100 40GB SXM": {"matmul_peak_fraction": 0.88, "matmul_min_intensity": 64.0},
    # Volta has no FlashAttention kernels: SDPA runs the memory-efficient one
    "V100 SXM": {"matmul_peak_fraction": 0.80, "matmul_min_intensity": 64.0, "attention_kernel": "efficient"},
    # Hopper: cuBLAS bf16 reaches ~797 TF/s at 8192^3 on an H100 SXM (the best published
    # single-kernel figure); the tile model gives 737 at a 0.78 fraction, whose measurement
    # already held the tiling losses the model subtracts again: 0.78 x 797 / 737 = 0.8435.
    # PyTorch SDPA runs FlashAttention-2's kernels (not FA3): ~350-400 TF/s forward of
    # 989 (FA3 paper, Shah et al. 2024, Fig. 5 FA2 baselines), backward ~300; cuDNN 9's
    # Hopper kernels ~550-650 forward (FA3 paper's cuDNN baseline; cuDNN release notes).
    "H100 SXM": {"matmul_peak_fraction": 0.8435, "nvls_fraction": 480 / 450,
                 "attention": {"flash": [0.38, 0.30], "cudnn": [0.60, 0.45], "efficient": [0.20, 0.16]}},
    "H200 SXM": {"matmul_peak_fraction": 0.80, "nvls_fraction": 480 / 450,
                 "attention": {"flash": [0.40, 0.32], "cudnn": [0.62, 0.47], "efficient": [0.20, 0.16]}},
    "H100 PCIe": {"matmul_peak_fraction": 0.75,
                  "attention": {"flash": [0.40, 0.32], "cudnn": [0.60, 0.45], "efficient": [0.20, 0.16]}},
    "H100 NVL": {"matmul_peak_fraction": 0.76,
                 "attention": {"flash": [0.40, 0.32], "cudnn": [0.60, 0.45], "efficient": [0.20, 0.16]}},
    # MI300X: hipBLASLt bf16 GEMMs reach ~600-700 TF/s of 1,307 (AMD ROCm performance
    # blogs, SemiAnalysis MI300X benchmarks 2024): ~0.5; CK flash attention ~0.3/0.2.
    "MI300X": {"matmul_peak_fraction": 0.50, "attention": {"flash": [0.30, 0.20], "cudnn": [0.30, 0.20],
                                                            "efficient": [0.20, 0.15]}},
    # Ada (L4, L40S): power-capped parts; cuBLAS ~0.6-0.7 of the boost-clock peak.
    "L4": {"matmul_peak_fraction": 0.60},
    "L40S": {"matmul_peak_fraction": 0.70},
    "B200 SXM": {"matmul_peak_fraction": 0.75, "nvls_fraction": 480 / 450,
                 "attention": {"flash": [0.35, 0.28], "cudnn": [0.60, 0.45], "efficient": [0.2, 0.15]}},
}

# NCCL src/graph/tuning.cc cost-model constants (NCCL 2.x), microseconds.
# baseLat[algo][proto], hwLat[link][algo][proto]; protocols (LL, Simple) (LL128 is enabled
# by default only on some systems and sits between the two).
_BASE_LAT = {"tree": {"LL": 6.8, "Simple": 0.0}, "ring": {"LL": 6.6, "Simple": 8.4}}
_HW_LAT = {"nvlink": {"tree": {"LL": 0.52, "Simple": 28.0}, "ring": {"LL": 0.47, "Simple": 3.4}},
           "pci": {"tree": {"LL": 1.0, "Simple": 28.0}, "ring": {"LL": 1.0, "Simple": 5.7}},
           "net": {"tree": {"LL": 5.0, "Simple": 50.0}, "ring": {"LL": 2.7, "Simple": 9.6}}}
# LL sends 8-byte lines with a 4-byte flag: 1/4 of the bandwidth across nodes and for
# all-reduce (tuning.cc), 1/3 otherwise; tree bandwidth is 0.9 x the ring's (tuning.cc), LL
# tree 1/3.8 of that.
_LL_FACTOR = 0.25
# tuning.cc: NVLS's hardware latency on NVLink, Simple protocol (its only one), microseconds.
_NVLS_LAT = 25.0


def efficiency(gpu) -> dict:
    """The efficiency parameters for ``gpu``: defaults, the part's built-in row, then its own
    ``efficiency`` (``TORCHLEDGER_HARDWARE`` / ``calibrate``), later ones winning."""
    out = dict(DEFAULT_EFFICIENCY)
    for row in (PART_EFFICIENCY.get(getattr(gpu, "name", ""), {}), getattr(gpu, "efficiency", {}) or {}):
        for k, v in row.items():
            if k == "attention" and isinstance(v, Mapping):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out


def peak_dtype(dtype: str, eff: Mapping) -> str:
    """Which peak column a matmul of ``dtype`` runs at: fp32 at fp32 unless TF32 is allowed."""
    if dtype == "fp32" and eff.get("allow_tf32"):
        return "tf32"
    return dtype if dtype in DTYPE_BYTES else "fp32"


def dense_peak(gpu, dtype: str, eff: Mapping) -> float:
    col = peak_dtype(dtype, eff)
    peak = gpu.peak_flops.get(col)
    if not peak and col in ("bf16", "fp16", "fp8"):     # no figure for the column: its 16-bit one
        peak = gpu.peak_flops.get("bf16") or gpu.peak_flops.get("fp16")
    if not peak:
        raise ValueError(f"{gpu.name} has no {col} peak in the hardware table (the step's matmuls are {dtype}); "
                         f"give one in ${HARDWARE_ENV} ({{\"{gpu.name}\": {{\"peak_flops\": {{\"{col}\": ...}}}}}})")
    return float(peak)


def matmul_fraction(m: int, n: int, k: int, batch: int, dtype: str, gpu, eff: Optional[Mapping] = None,
                    ) -> tuple:
    """``(compute seconds, tile)`` of a [batch x] (m x k) @ (k x n) GEMM from its tiling alone
    (no memory roofline, no launch floor): the fastest of the candidate tiles and split-K
    factors. See the module docstring for the model and a hand check."""
    eff = eff or efficiency(gpu)
    sms = gpu.sm_count or 100
    peak = dense_peak(gpu, dtype, eff) * float(eff["matmul_peak_fraction"])
    kt = int(eff["matmul_k_tile"])
    over = float(eff["matmul_k_overhead"])
    best = (math.inf, None)
    per_sm = peak / sms
    sustained = float(eff.get("sustained_fraction", 1.0))
    elt = DTYPE_BYTES.get(dtype, 4)
    # the feed bandwidth is the part's: a slower column (fp32 SIMT) needs proportionally less
    top = gpu.peak_flops.get("bf16") or gpu.peak_flops.get("fp16")
    need = float(eff["matmul_min_intensity"]) * (peak / (top * float(eff["matmul_peak_fraction"])) if top else 1.0)
    for tm, tn in eff["matmul_tiles"]:
        # skinny shapes run small-tile variants (cuBLAS's gemv-like and 16/32-row kernels):
        # a tile side shrinks to the next power of two >= the dimension, never under 16
        tm = min(tm, max(16, 1 << max(int(m) - 1, 0).bit_length()))
        tn = min(tn, max(16, 1 << max(int(n) - 1, 0).bit_length()))
        feed = min(1.0, 2.0 * tm * tn / ((tm + tn) * elt) / need)   # operand-feed bound of the tile
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        k_iters = math.ceil(k / kt)
        split = 1
        while True:
            units = tiles * split
            waves = math.ceil(units / sms)
            t = waves * (math.ceil(k_iters / split) + over) * (2.0 * tm * tn * kt) / (per_sm * feed * sustained)
            if t < best[0]:
                best = (t, (tm, tn, split))
            if tiles >= sms or units * 2 > 4 * sms or split * 2 > k_iters:
                break       # split-K only for fewer tiles than SMs, up to ~4 waves of slices
            split *= 2
    return best


def matmul_seconds(m: int, n: int, k: int, batch: int = 1, dtype: str = "bf16", gpu=None,
                   eff: Optional[Mapping] = None, shared_b: bool = False) -> float:
    """Seconds of one [batch x] (m x k) @ (k x n) matmul on ``gpu``: the slowest of its tiled
    compute (:func:`matmul_fraction`), its memory roofline (A, B and C once each at
    ``memory_fraction`` of HBM; ``shared_b``: one B for the whole batch) and the launch floor."""
    eff = eff or efficiency(gpu)
    compute, _ = matmul_fraction(m, n, k, batch, dtype, gpu, eff)
    elt = DTYPE_BYTES.get(dtype, 4)
    nbytes = elt * (batch * m * k + (1 if shared_b else batch) * k * n + batch * m * n)
    return max(compute, memory_seconds(nbytes, gpu, eff, floor=False), float(eff["launch_s"]))


#: Why :func:`sdpa_kernel` picks what it picks, for the step time's assumptions line.
SDPA_KERNEL_WHY = {
    "16-bit": "SDPA's choice for 16-bit inputs there",
    "efficient": ("SDPA's choice for fp32 inputs, flash and cuDNN taking 16-bit only: the memory-efficient "
                  "kernel, 3xTF32 on tensor cores from sm80 at a third of the TF32 peak"),
    "math": ("SDPA's fallback for fp32 inputs whose head dim is not a multiple of 4: bmm, softmax and bmm, "
             "the scores written to HBM"),
    "traced math": ("as the traced device ran it, its fused kernel having refused the call as a GPU's refuse "
                    "3-D inputs: the bmms at the matmul rate"),
}


def sdpa_kernel(dtype: str, gpu, eff: Optional[Mapping] = None, d: Optional[int] = None,
                dv: Optional[int] = None) -> str:
    """The kernel PyTorch's SDPA runs on ``gpu`` for inputs of ``dtype`` (``select_sdp_backend``
    in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: cuDNN or flash, then memory-
    efficient, then math). 16-bit inputs: the part's ``attention_kernel`` (flash; cuDNN under
    TE; memory-efficient on a V100, which flash does not support). fp32 inputs: flash and cuDNN
    accept fp16/bf16 only (``check_dtypes_low_precision``), the memory-efficient kernel takes
    fp32 on sm50 and later when both head dims are multiples of ``minimum_gemm_alignment``
    (4 with tensor cores, sm80 on: a part with a TF32 figure; 1 before), else the math path.

    >>> sdpa_kernel("fp32", get_gpu("h100"), d=64)     # 'efficient'
    >>> sdpa_kernel("fp32", get_gpu("h100"), d=66)     # 'math'

    Known limitations: a mask passed to a 16-bit call (flash takes none: SDPA runs the
    memory-efficient kernel) and 3-D inputs (every fused kernel wants 4-D: math) are not seen."""
    eff = eff or efficiency(gpu)
    if dtype in ("bf16", "fp16", "fp8"):
        return eff["attention_kernel"]
    if eff.get("attention_kernel_fp32"):
        return eff["attention_kernel_fp32"]
    align = 4 if gpu.peak_flops.get("tf32") else 1
    if any(x is not None and int(x) % align for x in (d, dv)):
        return "math"
    return "efficient"


def attention_peak(gpu, dtype: str, kernel: str, eff: Mapping) -> float:
    """The peak FLOP/s a fused attention kernel's fraction applies to: the dtype's, except the
    memory-efficient kernel on fp32 inputs, which runs 3xTF32 on tensor cores where the part
    has them (CUTLASS's ``OpMultiplyAddFastF32`` in its ``DefaultGemmType`` for sm80+: three
    TF32 MMAs per fp32 product, a third of the TF32 peak; the fp32 SIMT peak before sm80)."""
    if dtype == "fp32" and kernel == "efficient" and gpu.peak_flops.get("tf32"):
        return float(gpu.peak_flops["tf32"]) / 3.0
    return dense_peak(gpu, dtype, eff)


def _math_attention_seconds(b, hq, sq, sk, d, dv, backward, dtype, gpu, eff) -> float:
    """The math path: its bmms (forward Q K^T and P V; backward dV, dP, dQ, dK), each with its
    memory roofline and launch floor, and the softmax over the score matrix it writes to HBM
    (forward: read S, write P; backward: read P and dP, write dS). A causal call still runs
    every pair (the mask is applied to the dense scores)."""
    bh = b * hq
    mms = ([(sk, dv, sq), (sq, sk, dv), (sq, d, sk), (sk, d, sq)] if backward else [(sq, sk, d), (sq, dv, sk)])
    t = sum(matmul_seconds(m, n, k, bh, dtype, gpu, eff) for m, n, k in mms)
    scores = DTYPE_BYTES.get(dtype, 4) * bh * sq * sk * (3 if backward else 2)
    return t + memory_seconds(scores, gpu, eff)


def attention_seconds(b: int, hq: int, sq: int, sk: int, d: int, dv: int, causal: bool, backward: bool,
                      dtype: str, gpu, kernel: Optional[str] = None, eff: Optional[Mapping] = None) -> float:
    """Seconds of one fused attention call (flash, cuDNN or memory-efficient) forward or backward.

    ``d``: the query/key head dim, ``dv``: the value head dim (they differ in DeepSeek's latent
    attention: 192 and 128). Executed FLOPs: 2 x b x hq x sq x sk x (d + dv), halved when causal
    (the kernels skip the masked blocks), x 2.5 for the backward (four score-sized matmuls plus
    the recomputed Q K^T); bytes: Q (sq x d), O (sq x dv), K (sk x d) and V (sk x dv) per head. Rate: the kernel's fraction of peak x S / (S + attention_seq_half) x (d/128)^0.3
    for head dims under 128 (FA2 paper: d=64 runs ~15-20% slower than d=128), x
    ``attention_causal_fraction`` when causal (masked diagonal blocks, uneven rows).

    ``kernel`` None: the one SDPA picks for ``dtype`` (:func:`sdpa_kernel`: flash for 16-bit
    inputs, memory-efficient for fp32 at a third of the TF32 peak, :func:`attention_peak`);
    ``"math"``: priced as its bmms and softmax (:func:`_math_attention_seconds`). NB: the
    memory-efficient kernel on fp32 is given its 16-bit fraction of that peak (no published
    fp32 figure)."""
    eff = eff or efficiency(gpu)
    kernel = kernel or sdpa_kernel(dtype, gpu, eff, d, dv)
    if kernel == "math":
        return _math_attention_seconds(b, hq, sq, sk, d, dv, backward, dtype, gpu, eff)
    fwd, bwd = eff["attention"].get(kernel, eff["attention"]["flash"])
    flops = 2.0 * b * hq * sq * sk * (d + dv) * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    s = min(sq, sk) if sq > 1 else sk
    frac = (bwd if backward else fwd) * s / (s + float(eff["attention_seq_half"]))
    if causal:
        frac *= float(eff.get("attention_causal_fraction", 1.0))
    frac = max(frac * min(1.0, d / 128.0) ** 0.3 * float(eff.get("sustained_fraction", 1.0)), 1e-6)
    compute = flops / (attention_peak(gpu, dtype, kernel, eff) * frac)
    elt = DTYPE_BYTES.get(dtype, 2)
    io = elt * b * hq * (sq + sk) * (d + dv) * (2.5 if backward else 1.0)     # Q, O; K, V
    return max(compute, memory_seconds(io, gpu, eff, floor=False), float(eff["launch_s"]))


def memory_seconds(nbytes: float, gpu, eff: Optional[Mapping] = None, floor: bool = True) -> float:
    """Seconds to read + write ``nbytes`` at ``memory_fraction`` of HBM bandwidth, never less
    than the launch floor (``floor=False``: the bandwidth term alone)."""
    eff = eff or efficiency(gpu)
    t = nbytes / (gpu.bandwidth_bytes_per_s * float(eff["memory_fraction"]))
    return max(t, float(eff["launch_s"])) if floor else t


def group_layout(group_size: int, span: Optional[int], gpus_per_node: int) -> tuple:
    """``(ranks of the group per node, nodes)`` for a group of ``group_size`` ranks whose global
    ranks span ``span`` (torchrun places ranks node by node): a contiguous group fills nodes,
    a strided one (an FSDP group across TP ranks, stride 8) has one rank per node."""
    n = max(int(group_size), 1)
    if n == 1:
        return 1, 1
    if span is None or span <= n:
        r = min(n, gpus_per_node)
    else:
        stride = (span - 1) / (n - 1)
        r = max(1, min(n, int(math.ceil(gpus_per_node / stride)) if stride < gpus_per_node else 1))
    return r, int(math.ceil(n / r))


def bus_bandwidth(group_size: int, span: Optional[int], gpu, eff: Optional[Mapping] = None) -> tuple:
    """``(bytes/s, link)`` of one group's ring: NVLink within one node; across nodes the
    node's NICs shared by the ``gpus_per_node / r`` groups that run at once, i.e.
    ``nics x nic x r / gpus_per_node`` (and never more than NVLink)."""
    eff = eff or efficiency(gpu)
    gpn = gpu.gpus_per_node or 8
    r, nodes = group_layout(group_size, span, gpn)
    nvlink = (gpu.nvlink_bytes_per_s or 32e9) * float(eff["nvlink_fraction"])
    if nodes == 1:
        return nvlink, "nvlink" if (gpu.nvlink_bytes_per_s or 0) > 64e9 else "pci"
    nic = (gpu.nic_bytes_per_s or 25e9) * float(eff["network_fraction"])
    share = (gpu.nics_per_node or gpn) * nic * min(r, gpn) / gpn
    return min(nvlink, share), "net"


def collective_seconds(op: str, nbytes: float, group_size: int, span: Optional[int], gpu,
                       eff: Optional[Mapping] = None) -> tuple:
    """``(seconds, algorithm)`` of one collective of ``nbytes`` (NCCL-tests' size: the buffer
    of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter)
    over a group of ``group_size`` ranks spanning ``span`` global ranks.

    Hand check (ring, Simple, one node): all-reduce of 1 GB over 8 H100s: latency 8.4 + 14 x
    3.4 = 56 us, bus bytes 2 x 7/8 x 1 GB = 1.75 GB at 0.8 x 450 GB/s = 4.861 ms; 4.917 ms."""
    eff = eff or efficiency(gpu)
    n = max(int(group_size), 1)
    if n == 1 or nbytes <= 0:
        return 0.0, "none"
    gpn = gpu.gpus_per_node or 8
    r, nodes = group_layout(n, span, gpn)
    bw, link = bus_bandwidth(n, span, gpu, eff)
    intra = "nvlink" if link == "nvlink" or (nodes > 1 and (gpu.nvlink_bytes_per_s or 0) > 64e9) else "pci"
    if op == "all_reduce" and nodes == 1 and float(eff.get("nvls_fraction") or 0) > 0 and link == "nvlink":
        nvls = _NVLS_LAT * 1e-6 + nbytes * 2.0 * (n - 1) / n / (gpu.nvlink_bytes_per_s * float(eff["nvls_fraction"]))
    else:
        nvls = math.inf
    if op == "all_reduce":
        steps, inter, factor = 2 * (n - 1), 2 * (nodes - 1), 2.0 * (n - 1) / n
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        steps, inter, factor = n - 1, nodes - 1, (n - 1) / n
    else:               # broadcast, send, recv: the buffer once over the link
        steps, inter, factor = (n if op == "broadcast" else 1), (nodes if nodes > 1 else 0), 1.0
    best = (nvls, "nvls/Simple")
    for proto in ("LL", "Simple"):
        lat = _BASE_LAT["ring"][proto] + (steps - inter) * _HW_LAT[intra]["ring"][proto] \
            + inter * _HW_LAT["net"]["ring"][proto]
        if proto == "Simple" and nodes > 1 and op == "all_reduce" and nbytes >= n / 16 * 65536:
            lat *= 1.9          # tuning.cc: "plateau effect of ring"
        pbw = bw * (_LL_FACTOR if proto == "LL" else 1.0)
        t = lat * 1e-6 + nbytes * factor / pbw
        if t < best[0]:
            best = (t, f"ring/{proto}")
        if op == "all_reduce" and nodes > 1:     # NCCL tries the tree for all-reduce only
            tlat = _BASE_LAT["tree"][proto] + 2 * ((r - 1) * _HW_LAT[intra]["tree"][proto]
                                                   + math.log2(nodes) * _HW_LAT["net"]["tree"][proto])
            tbw = bw * 0.9 * (1 / 3.8 if proto == "LL" else 1.0)
            t = tlat * 1e-6 + 2.0 * nbytes / tbw
            if t < best[0]:
                best = (t, f"tree/{proto}")
    return best


def overlap_timeline(units: list, tail_compute: float = 0.0, head_compute: float = 0.0) -> dict:
    """Two streams, compute and communication, over an ordered list of ``units`` (the FSDP
    units of one pass, in the order they run): each unit is ``(pre_comm, compute, post_comm)``.

    A unit's ``pre_comm`` (its all-gather) must finish before its compute starts, and is issued
    when the *previous* unit's compute starts (FSDP2's prefetch: the all-gather of block i+1
    runs under the compute of block i); its ``post_comm`` (reduce-scatter) is issued when its
    compute ends and runs under the next units' compute. Collectives run one at a time on the
    communication stream, in issue order. ``head_compute`` runs before the first unit (no
    communication needed), ``tail_compute`` after the last. Returns ``{"seconds", "compute",
    "comm", "exposed"}``: exposed = seconds - compute, the communication nothing hid.

    Hand check: units (2, 5, 0), (2, 5, 0), (2, 5, 0): comm 0-2, compute 2-7; the second
    gather is issued at 2, runs 2-4, compute 7-12; third 7-9, compute 12-17: 17 s, 2 exposed.
    """
    t_comp = head_compute
    comm_free = 0.0
    prev_start = 0.0
    pending_post: list = []            # (issue time, duration) of reduce-scatters
    total_comm = 0.0
    for i, (pre, comp, post) in enumerate(units):
        # collectives issued before this gather (earlier reduce-scatters) go first
        issue = prev_start if i else 0.0
        for when, dur in sorted(pending_post):
            if when <= issue:
                comm_free = max(comm_free, when) + dur
        pending_post = [(w, d) for w, d in pending_post if w > issue]
        gather_done = max(comm_free, issue) + pre if pre else 0.0
        if pre:
            comm_free = gather_done
        start = max(t_comp, gather_done)
        prev_start = start
        t_comp = start + comp
        total_comm += pre + post
        if post:
            pending_post.append((t_comp, post))
    for when, dur in sorted(pending_post):
        comm_free = max(comm_free, when) + dur
    compute = head_compute + sum(c for _, c, _ in units) + tail_compute
    end = max(t_comp + tail_compute, comm_free)
    return {"seconds": end, "compute": compute, "comm": total_comm, "exposed": max(0.0, end - compute)}
