"""Inference: KV-cache size and the bandwidth-bound decode step.

KV cache: per token, every layer stores one key and one value
vector per KV head::

    bytes_per_token = 2 * L * h_kv * d_h * bytes_per_value

Llama 2 70B (L 80, h_kv 8, d_h 128, bf16): 327,680 B = 320 KiB per token; 32,768 tokens
= 10 GiB (80 GiB with 64 KV heads, i.e. without grouped-query attention).

Decode: each step reads every weight once, and does 2 FLOPs per matmul parameter per
sequence in the batch. So per step::

    memory time  = weight bytes / HBM bandwidth        (the same at any batch)
    compute time = 2 * N_matmul * batch / peak FLOP/s
    step time    = max(memory time, compute time)       (perfect overlap assumed)

N_matmul is the parameters that multiply (the LM head counts, the embedding lookup does
not; :mod:`torchledger.formulas.params`). The batch at which compute time catches up
with memory time is the *critical batch*: memory time / compute time at batch 1.
Llama 3 8B, bf16, H100: 16.1 GB / 3.35 TB/s = 4.79 ms vs 15.2 us -> ~209 tokens/s at
batch 1; critical batch 4.79 ms / 15.17 us = 316 (4.79 / 15.2 rounds to ~315).

Known limitations:
  - the KV cache read per step (grows with context and batch) and attention FLOPs are not
    in the decode step; nor are kernel launch overheads, so real steps are slower.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from .flops import exact
from .hardware import get_gpu, normalize_dtype

__all__ = ["KV_DTYPES", "KVCache", "kv_cache", "DecodeEstimate", "decode_step", "DTYPE_BYTES"]

#: Bytes per stored K/V value.
KV_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
#: Bytes per weight when the model runs in a compute dtype.
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVCache:
    """KV-cache size of ``tokens`` x ``batch`` cached positions."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    tokens: int
    batch: int
    dtype: str
    bytes_per_token: int
    """2 * L * h_kv * d_h * bytes per value, one sequence position."""
    total_bytes: int
    """bytes_per_token * tokens * batch."""

    def to_dict(self) -> dict:
        return asdict(self)


def kv_cache(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, *, batch: int = 1,
             dtype: str = "bf16") -> KVCache:
    """KV-cache bytes; see the module docstring. Exact ints."""
    key = str(dtype).lower()
    if key not in KV_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {dtype!r}; expected one of "
                         f"{', '.join(KV_DTYPES)}")
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim), ("tokens", tokens), ("batch", batch)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    per_token = 2 * n_layers * n_kv_heads * head_dim * KV_DTYPES[key]
    return KVCache(n_layers, n_kv_heads, head_dim, tokens, batch, key, per_token,
                   per_token * tokens * batch)


@dataclass(frozen=True)
class DecodeEstimate:
    """One decode step of a batch of sequences, one new token each."""

    n_params: float
    """Parameters whose weights are read each step."""
    matmul_params: float
    """Parameters that multiply each token (2 FLOPs each)."""
    batch: int
    dtype: str
    bandwidth_bytes_per_s: float
    peak_flops: float
    weight_bytes: float
    memory_s: float
    """weight_bytes / bandwidth."""
    compute_s: float
    """2 * matmul_params * batch / peak_flops."""
    step_s: float
    tokens_per_s: float
    """batch / step_s."""
    critical_batch: float
    """Batch at which compute time equals memory time."""
    bound: str
    """'memory' or 'compute', whichever sets step_s."""

    @property
    def ms_per_step(self) -> float:
        return self.step_s * 1e3

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ms_per_step"] = self.ms_per_step
        return out


def decode_step(n_params, gpu=None, *, dtype: str = "bf16", batch: int = 1,
                matmul_params=None, peak_flops: Optional[float] = None,
                bandwidth: Optional[float] = None) -> DecodeEstimate:
    """Bandwidth- and compute-time of one decode step on ``gpu`` (a name or GPUSpec).

    ``matmul_params`` defaults to ``n_params`` (then the embedding is counted as if it
    multiplied; pass the exact figure from :func:`count_params` when you have it).
    ``peak_flops`` and ``bandwidth`` override the GPU's figures (one of gpu or both needed).
    """
    key = normalize_dtype(dtype)
    spec = get_gpu(gpu) if gpu is not None else None
    if spec is None and (peak_flops is None or bandwidth is None):
        raise ValueError("decode_step needs a gpu, or both peak_flops and bandwidth")
    peak = peak_flops if peak_flops is not None else spec.peak(key)
    bw = bandwidth if bandwidth is not None else spec.bandwidth_bytes_per_s
    n_mm = exact(matmul_params if matmul_params is not None else n_params)
    weights = exact(n_params) * DTYPE_BYTES[key]
    memory_s, per_seq_s = weights / bw, 2 * n_mm / peak
    compute_s = per_seq_s * batch
    step_s = max(memory_s, compute_s)
    return DecodeEstimate(n_params=exact(n_params), matmul_params=n_mm, batch=batch, dtype=key,
                          bandwidth_bytes_per_s=bw, peak_flops=peak, weight_bytes=weights,
                          memory_s=memory_s, compute_s=compute_s, step_s=step_s,
                          tokens_per_s=batch / step_s, critical_batch=memory_s / per_seq_s,
                          bound="memory" if memory_s >= compute_s else "compute")
