"""Accelerator specs for the closed forms: memory, bandwidth, dense peak FLOP/s per dtype.

The built-in table is ACCOUNTING.md section 4 (SXM parts, dense math, no sparsity).
Units: memory in bytes with GB = 1e9 (vendor units), bandwidth in bytes/s, peaks in FLOP/s.
A dtype the part has no tensor-core figure for is ``None`` (the V100 has no bf16, the
B200 row gives no fp32/tf32).

    >>> get_gpu("H100-SXM").peak("bf16")
    989500000000000.0

Users add or override parts with :func:`register_gpu`, or with a JSON file named by the
environment variable ``TORCHLEDGER_HARDWARE``::

    {"L40S": {"memory": "48GB", "bandwidth": "864GB/s",
              "peak_flops": {"bf16": "362T", "fp8": "733T"}, "aliases": ["l40s-pcie"]}}

Known limitations:
  - peaks are the vendors' dense numbers; sustained clocks and power caps are not modelled.
  - one entry per part name: PCIe and SXM variants need separate names.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .. import units

__all__ = ["GPUSpec", "get_gpu", "register_gpu", "known_gpus", "normalize_dtype", "DTYPES",
           "HARDWARE_ENV"]

#: Dtypes that have a peak FLOP/s column.
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Environment variable naming a JSON file of extra or overriding GPU specs.
HARDWARE_ENV = "TORCHLEDGER_HARDWARE"

_TF = 1e12
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "half": "fp16", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8"}


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator part."""

    name: str
    """Display name, e.g. ``'H100 SXM'``."""
    memory_bytes: float
    """HBM capacity in bytes (80 GB = 80e9)."""
    bandwidth_bytes_per_s: float
    """HBM bandwidth in bytes/s (3.35 TB/s = 3.35e12)."""
    peak_flops: Mapping[str, Optional[float]] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype in :data:`DTYPES`; ``None`` where the part has none."""
    aliases: tuple = ()
    """Extra names it is found by (matched after normalisation, see :func:`get_gpu`)."""

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; ``ValueError`` naming the dtypes it has otherwise."""
        key = normalize_dtype(dtype)
        value = self.peak_flops.get(key)
        if value is None:
            have = [d for d in DTYPES if self.peak_flops.get(d)]
            raise ValueError(f"{self.name} has no {key} peak in the hardware table; "
                             f"it has {', '.join(have) or 'none'}")
        return float(value)

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": self.memory_bytes,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "peak_flops": {d: self.peak_flops.get(d) for d in DTYPES}}


def _spec(name, mem_gb, bw_tb, fp32, tf32, bf16, fp16, fp8, aliases=()):
    peaks = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    return GPUSpec(name, mem_gb * 1e9, bw_tb * 1e12,
                   {k: (v * _TF if v is not None else None) for k, v in peaks.items()},
                   tuple(aliases))


_BUILTIN = [
    _spec("V100 SXM", 32, 0.9, 15.7, None, None, 125, None, ["v100-32gb", "tesla-v100"]),
    _spec("A100 SXM", 80, 2.0, 19.5, 156, 312, 312, None, ["a100-80gb"]),
    _spec("H100 SXM", 80, 3.35, 67, 495, 989.5, 989.5, 1979, ["h100-80gb"]),
    _spec("H200 SXM", 141, 4.8, 67, 495, 989.5, 989.5, 1979, ["h200-141gb"]),
    _spec("B200 SXM", 192, 8.0, None, None, 2250, 2250, 4500, ["b200-192gb"]),
]

_REGISTRY: dict = {}
_ENV_LOADED: Optional[str] = None


def _key(name: str) -> str:
    """'NVIDIA H100-SXM5' -> 'h100': lower case, no punctuation, no vendor or form factor."""
    k = re.sub(r"[^a-z0-9]", "", str(name).lower())
    k = re.sub(r"^(nvidia|tesla)", "", k)
    return re.sub(r"sxm[0-9]?$", "", k) or k


def register_gpu(name: str, memory, bandwidth, peak_flops: Mapping, aliases=()) -> GPUSpec:
    """Add or replace a part. Sizes may be numbers or strings (``'80GB'``, ``'3.35TB/s'``,
    ``'989.5T'``). Returns the stored :class:`GPUSpec`; later lookups find it by any alias.
    """
    peaks = {normalize_dtype(k): (units.parse_flops(v) if v is not None else None)
             for k, v in dict(peak_flops).items()}
    bw = bandwidth.rstrip("/sS") if isinstance(bandwidth, str) else bandwidth
    spec = GPUSpec(str(name), units.parse_bytes(memory), units.parse_bytes(bw), peaks,
                   tuple(aliases))
    _store(spec)
    return spec


def _store(spec: GPUSpec) -> None:
    for alias in (spec.name, *spec.aliases):
        _REGISTRY[_key(alias)] = spec


def _ensure_loaded() -> None:
    global _ENV_LOADED
    if not _REGISTRY:
        for spec in _BUILTIN:
            _store(spec)
    path = os.environ.get(HARDWARE_ENV, "")
    if path and path != _ENV_LOADED:
        _load_file(path)
        _ENV_LOADED = path


def _load_file(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        for name, row in table.items():
            register_gpu(name, row["memory"], row["bandwidth"], row.get("peak_flops", {}),
                         row.get("aliases", ()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"{HARDWARE_ENV}={path}: expected a JSON object of "
                         f'{{"NAME": {{"memory": "80GB", "bandwidth": "3.35TB/s", '
                         f'"peak_flops": {{"bf16": "989.5T"}}}}}}, but reading it failed: '
                         f"{type(e).__name__}: {e}") from None


def known_gpus() -> list:
    """Display names of every known part, built-in and registered."""
    _ensure_loaded()
    return list(dict.fromkeys(spec.name for spec in _REGISTRY.values()))


def get_gpu(name) -> GPUSpec:
    """Look a part up by name, case-insensitively: ``'h100'``, ``'H100-SXM'``, ``'NVIDIA H100'``.

    A :class:`GPUSpec` is returned as it is. Unknown names raise ``ValueError`` listing the
    known parts.
    """
    if isinstance(name, GPUSpec):
        return name
    _ensure_loaded()
    spec = _REGISTRY.get(_key(name))
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpus())} "
                         f"(add one with register_gpu() or ${HARDWARE_ENV})")
    return spec


def normalize_dtype(dtype: str) -> str:
    """``'bfloat16'`` -> ``'bf16'``; unknown names raise ``ValueError`` listing the known ones."""
    key = str(dtype).lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return key
