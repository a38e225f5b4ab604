"""Accelerator specs for the closed forms: memory, bandwidth, dense peak FLOP/s per dtype.

The built-in table: vendor datasheets, one row per part (dense math only:
a datasheet's "with sparsity" figure is twice the dense one and is never used here; every
row says where its figures come from in ``GPUSpec.sources``). Units: memory in bytes, the
capacity the runtime reports rather than the datasheet's round figure (an "80 GB" H100 gives
a process 79.18 GiB = 85.0e9 B; a "192 GB" B200 178.35 GiB = 191.5e9 B: see ``_USABLE_GIB``),
bandwidth in bytes/s (GB = 1e9, vendor units), peaks in FLOP/s. A dtype the part has no
tensor-core figure for is ``None`` (the V100 has no bf16, the B200 row gives no fp32/tf32).

Beyond the datasheet figures a part carries what the step-time model
(:mod:`torchledger.formulas.steptime`) needs: SM count, NVLink per GPU and NIC bandwidth
per NIC (both one direction), GPUs and NICs per node, and ``efficiency``, the kernel
efficiency parameters (their defaults and sources are in ``steptime.DEFAULT_EFFICIENCY``;
``torchledger calibrate`` fits them from measured records).

    >>> get_gpu("H100-SXM").peak("bf16")
    989500000000000.0

Users add or override parts with :func:`register_gpu`, or with a JSON file named by the
environment variable ``TORCHLEDGER_HARDWARE``::

    {"L40S": {"memory": "48GB", "bandwidth": "864GB/s",
              "peak_flops": {"bf16": "362T", "fp8": "733T"}, "aliases": ["l40s-pcie"]},
     "H100 SXM": {"efficiency": {"matmul_peak_fraction": 0.74}, "nic": "50GB/s"}}

A row naming a known part may give only the fields it changes (``calibrate`` writes such
rows); a new part needs ``memory``, ``bandwidth`` and ``peak_flops``. Every field is checked
when the file is read (type, unit, range; :mod:`.hardware_fields`): a bad one, a misspelt key
or a file that is not a regular JSON file is one line naming the file, the part and the field,
and no part of that file is registered. Bandwidths read as ``--link-bandwidth`` does:
``B`` bytes, ``b`` bits (``"nic": "400Gb/s"`` is 50 GB/s).

Known limitations:
  - peaks are the vendors' dense numbers; sustained clocks and power caps are not modelled.
  - one entry per part name: PCIe and SXM variants need separate names.
  - the network figures describe the vendor's reference node (DGX/HGX, one NIC per GPU);
    a cluster with fewer NICs per node should say so in ``TORCHLEDGER_HARDWARE``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from ..inputs import InputFileError, read_input
from .hardware_fields import DTYPES, HardwareFieldError, check_row, normalize_dtype

__all__ = ["GPUSpec", "get_gpu", "register_gpu", "known_gpus", "normalize_dtype", "DTYPES",
           "HARDWARE_ENV", "HardwareFileError", "read_table"]

#: Environment variable naming a JSON file of extra or overriding GPU specs.
HARDWARE_ENV = "TORCHLEDGER_HARDWARE"

_TF = 1e12
#: The largest hardware file read (a table of every part ever made is a few KB).
HARDWARE_MAX_BYTES = 4 * 2**20


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator part."""

    name: str
    """Display name, e.g. ``'H100 SXM'``."""
    memory_bytes: float
    """Device memory a process can allocate from, in bytes: for the built-in parts the total
    the CUDA/HIP runtime reports (``torch.cuda.get_device_properties(0).total_memory``, the
    "total capacity" of an out-of-memory message: an H100 80GB reports 79.18 GiB = 85.0e9 B,
    not the datasheet's 80e9), so "fits" is judged against what the allocator can hand out.
    Parts registered by users: the figure they give."""
    bandwidth_bytes_per_s: float
    """HBM bandwidth in bytes/s (3.35 TB/s = 3.35e12)."""
    peak_flops: Mapping[str, Optional[float]] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype in :data:`DTYPES`; ``None`` where the part has none."""
    aliases: tuple = ()
    """Extra names it is found by (matched after normalisation, see :func:`get_gpu`)."""
    sm_count: Optional[int] = None
    """Streaming multiprocessors (AMD: compute units): what a matmul's tiles are spread over."""
    nvlink_bytes_per_s: Optional[float] = None
    """GPU-to-GPU bandwidth inside a node, per GPU, one direction (NVLink, Infinity Fabric;
    PCIe where the part has no such link). Vendors quote both directions: half of it."""
    nic_bytes_per_s: Optional[float] = None
    """One NIC's bandwidth, one direction (NDR InfiniBand 400 Gb/s = 50 GB/s)."""
    nics_per_node: int = 8
    """NICs in the reference node (DGX/HGX: one per GPU)."""
    gpus_per_node: int = 8
    """GPUs in the reference node."""
    efficiency: Mapping[str, Any] = field(default_factory=dict)
    """Kernel efficiency parameters that differ from ``steptime.DEFAULT_EFFICIENCY``."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each figure comes from: ``{"peak_flops": "...", "nic": "...", ...}``."""

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
                "peak_flops": {d: self.peak_flops.get(d) for d in DTYPES},
                "sm_count": self.sm_count, "nvlink_bytes_per_s": self.nvlink_bytes_per_s,
                "nic_bytes_per_s": self.nic_bytes_per_s, "nics_per_node": self.nics_per_node,
                "gpus_per_node": self.gpus_per_node, "efficiency": dict(self.efficiency),
                "sources": dict(self.sources)}


# The memory a process gets, in GiB: the total the CUDA (HIP) runtime reports for the part,
# as PyTorch prints it in its out-of-memory message ("GPU 0 has a total capacity of 79.19 GiB")
# and nvidia-smi shows it (H100 80GB HBM3: 81,559 MiB, less the driver's reservation). The
# datasheets' "80 GB" is neither 80e9 B nor 80 GiB of usable memory. Figures: the smallest
# total seen in public OOM reports for the part (GitHub issues and logs, 2023-2026); a part
# without one keeps its datasheet figure (GB = 1e9) and says so in its sources.
_USABLE_GIB = {
    "V100 SXM": (31.74, "V100 32GB OOM reports: '31.74 GiB total capacity'"),
    "A100 SXM": (79.15, "A100 80GB OOM reports: '79.15 GiB total capacity' (nvidia-smi 81,920 MiB)"),
    "A100 40GB SXM": (39.39, "A100 40GB OOM reports: '39.39 GiB total capacity'"),
    "H100 SXM": (79.18, "H100 80GB HBM3 OOM reports: 'a total capacity of 79.18 GiB' (79.19 on "
                        "other drivers; nvidia-smi 81,559 MiB)"),
    "H100 96GB 500W": (95.0, "torchtitan's published benchmarks: 'H100 GPUs with 95 GiB HBM2e'"),
    "H100 NVL": (93.09, "H100 NVL OOM reports: 'a total capacity of 93.09 GiB'"),
    "H200 SXM": (139.80, "H200 OOM reports: 'a total capacity of 139.80 GiB' (nvidia-smi 143,771 MiB)"),
    "B200 SXM": (178.35, "B200 OOM reports: 'a total capacity of 178.35 GiB' (the part exposes 180 GB)"),
    "MI300X": (191.98, "MI300X HIP OOM reports: 'a total capacity of 191.98 GiB'"),
    "H100 PCIe": (79.18, "nvidia-smi shows the H100 PCIe's 81,559 MiB as the SXM part's: the SXM "
                         "part's runtime total, 79.18 GiB"),
    "L4": (22.03, "L4 OOM reports: 'a total capacity of 22.03 GiB' (nvidia-smi 23,034 MiB, less the "
                  "479 MiB the H100 also loses between the two)"),
    "L40S": (44.39, "L40S OOM reports: 'a total capacity of 44.39 GiB' (44.4 GiB per L40S)"),
}


def _spec(name, mem_gb, bw_tb, fp32, tf32, bf16, fp16, fp8, aliases=(), sms=None, nvlink_gb=None,
          nic_gb=None, nics=8, gpus=8, efficiency=None, **sources):
    peaks = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    usable = _USABLE_GIB.get(name)
    sources.setdefault("memory", usable[1] if usable else
                       f"datasheet {mem_gb} GB (= {mem_gb}e9 B; the runtime's usable total not sourced)")
    return GPUSpec(name, usable[0] * 2**30 if usable else mem_gb * 1e9, bw_tb * 1e12,
                   {k: (v * _TF if v is not None else None) for k, v in peaks.items()},
                   tuple(aliases), sms, nvlink_gb * 1e9 if nvlink_gb else None,
                   nic_gb * 1e9 if nic_gb else None, nics, gpus, dict(efficiency or {}), sources)


# Peaks: the vendors' dense tensor-core figures (datasheets give "X | 2X with sparsity": X).
# fp32 is the non-tensor-core figure (MI300X: its matrix fp32). NVLink: the datasheet's
# bidirectional GPU figure / 2. NIC: the reference system's ConnectX per GPU, one direction
# (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s). PCIe parts: PCIe one direction (Gen4 x16
# 32 GB/s, Gen5 x16 64 GB/s) between GPUs, and one 400 Gb/s NIC per GPU assumed.
_BUILTIN = [
    _spec("V100 SXM", 32, 0.9, 15.7, None, None, 125, None, ["v100-32gb", "tesla-v100"], 80, 150, 12.5,
          4, 8, peaks="NVIDIA V100 datasheet (SXM2: 125 TF tensor, 15.7 TF fp32, 900 GB/s)",
          network="NVLink 2: 300 GB/s bidirectional; DGX-1: 4 x EDR 100 Gb/s per 8 GPUs"),
    _spec("A100 SXM", 80, 2.039, 19.5, 156, 312, 312, None, ["a100-80gb", "a100"], 108, 300, 25,
          peaks="NVIDIA A100 datasheet (80GB SXM: 312 TF bf16 dense, 624 sparse; 2,039 GB/s)",
          network="NVLink 3: 600 GB/s bidirectional; DGX A100: 8 x HDR 200 Gb/s ConnectX-6"),
    _spec("A100 40GB SXM", 40, 1.555, 19.5, 156, 312, 312, None, ["a100-40gb", "a100-sxm-40gb"], 108,
          300, 25, peaks="NVIDIA A100 datasheet (40GB SXM: 312 TF bf16 dense, 1,555 GB/s)",
          network="NVLink 3: 600 GB/s bidirectional; DGX A100 (40GB): 8 x HDR 200 Gb/s"),
    _spec("H100 SXM", 80, 3.35, 67, 494.7, 989.5, 989.5, 1979, ["h100-80gb", "h100", "h100-80gb-hbm3"], 132, 450, 50,
          peaks="NVIDIA H100 datasheet (SXM: 989 TF bf16 dense, 1,979 with sparsity; 3.35 TB/s)",
          network="NVLink 4: 900 GB/s bidirectional; DGX H100: 8 x NDR 400 Gb/s ConnectX-7"),
    # Meta's Grand Teton H100 (torchtitan's benchmark part): the SXM5 die with 96 GB of HBM2e
    # (6 stacks x 1,024 bits x 3.2 Gb/s = 2.46 TB/s, the HBM2e speed of the H100 PCIe's 5 stacks
    # at 2.0 TB/s) at a 500 W cap instead of 700 W. The datasheet peaks are at the boost clock;
    # a GEMM-bound step at 500 W runs the clock lower: dynamic power ~ f V^2 with V ~ f over
    # the DVFS range (P ~ f^3), so (500 / 700)^(1/3) = 0.894 of the 700 W part's sustained rate
    # (the H100 SXM row's matmul and attention fractions x 0.894).
    _spec("H100 96GB 500W", 96, 2.46, 67, 494.7, 989.5, 989.5, 1979, ["h100-96gb-500w", "h100-96gb"], 132, 450,
          50, efficiency={"matmul_peak_fraction": round(0.8435 * 0.894, 4), "nvls_fraction": round(480 / 450, 4),
                      "attention": {"flash": [round(0.38 * 0.894, 4), round(0.30 * 0.894, 4)],
                                    "cudnn": [round(0.60 * 0.894, 4), round(0.45 * 0.894, 4)],
                                    "efficient": [round(0.20 * 0.894, 4), round(0.16 * 0.894, 4)]}},
          peaks="NVIDIA H100 SXM5 datasheet peaks (989 TF bf16 dense); 96 GB HBM2e, 500 W (torchtitan's "
                "published benchmarks: 'H100 GPUs with 95 GiB HBM2e, 500 W TDP'); bandwidth 6 HBM2e stacks at "
                "3.2 Gb/s per pin",
          network="NVLink 4: 900 GB/s bidirectional; 8 x 400 Gb/s NICs per node assumed (as DGX H100)"),
    _spec("H100 PCIe", 80, 2.0, 51, 378, 756, 756, 1513, ["h100-pcie-80gb"], 114, 64, 50,
          peaks="NVIDIA H100 datasheet (PCIe: 756 TF bf16 dense, 1,513 with sparsity; 2 TB/s)",
          network="PCIe Gen5 x16 (64 GB/s one direction; NVLink bridges join pairs only, not "
                  "modelled); one NDR 400 Gb/s NIC per GPU assumed"),
    _spec("H100 NVL", 94, 3.9, 60, 417.5, 835, 835, 1671, ["h100-nvl-94gb"], 132, 64, 50,
          peaks="NVIDIA H100 NVL datasheet (835 TF bf16 dense, 1,671 with sparsity; 3.9 TB/s, 94 GB)",
          network="PCIe Gen5 x16 (64 GB/s; the 600 GB/s NVLink bridge joins pairs only, not "
                  "modelled); one NDR 400 Gb/s NIC per GPU assumed"),
    _spec("H200 SXM", 141, 4.8, 67, 494.7, 989.5, 989.5, 1979, ["h200-141gb", "h200"], 132, 450, 50,
          peaks="NVIDIA H200 datasheet (SXM: 989 TF bf16 dense; 4.8 TB/s, 141 GB)",
          network="NVLink 4: 900 GB/s bidirectional; DGX H200: 8 x NDR 400 Gb/s ConnectX-7"),
    _spec("B200 SXM", 192, 8.0, None, None, 2250, 2250, 4500, ["b200-192gb", "b200"], 148, 900, 50,
          peaks="NVIDIA DGX B200 datasheet (per GPU: 2.25 PF bf16 dense, 4.5 PF fp8 dense; 8 TB/s)",
          network="NVLink 5: 1.8 TB/s bidirectional; DGX B200: 8 x NDR 400 Gb/s ConnectX-7"),
    _spec("MI300X", 192, 5.3, 163.4, 653.7, 1307.4, 1307.4, 2614.9, ["instinct-mi300x", "amd-mi300x"],
          304, 448, 50,
          efficiency={"launch_s": 8e-6},
          peaks="AMD Instinct MI300X datasheet (1,307.4 TF bf16 dense, 2,614.9 with sparsity; "
                "163.4 TF fp32 matrix; 5.3 TB/s, 192 GB; 304 CUs)",
          network="Infinity Fabric: 7 links x 64 GB/s one direction = 448 GB/s per GPU; "
                  "8 x 400 Gb/s NICs per platform"),
    _spec("L4", 24, 0.3, 30.3, 60, 121, 121, 242.5, ["nvidia-l4", "l4-24gb"], 58, 32, 50,
          peaks="NVIDIA L4 datasheet (121 TF bf16 dense, 242 with sparsity; 300 GB/s, 24 GB)",
          network="PCIe Gen4 x16 (32 GB/s one direction), no NVLink; one 400 Gb/s NIC per GPU assumed"),
    _spec("L40S", 48, 0.864, 91.6, 183, 362.05, 362.05, 733, ["l40s-48gb"], 142, 32, 50,
          peaks="NVIDIA L40S datasheet (362.05 TF bf16 dense, 733 with sparsity; 864 GB/s, 48 GB)",
          network="PCIe Gen4 x16 (32 GB/s one direction), no NVLink; one 400 Gb/s NIC per GPU assumed"),
]


class HardwareFileError(ValueError):
    """The ``TORCHLEDGER_HARDWARE`` file cannot be used: one line naming the file, the part
    and the field."""


_REGISTRY: dict = {}
_ENV_LOADED: Optional[str] = None


def _key(name: str) -> str:
    """'NVIDIA H100-SXM5' -> 'h100': lower case, no punctuation, no vendor or form factor."""
    k = re.sub(r"[^a-z0-9]", "", str(name).lower())
    k = re.sub(r"^(nvidia|tesla|amd|instinct)+", "", k)
    return re.sub(r"sxm[0-9]?", "", k) or k


def register_gpu(name: str, memory=None, bandwidth=None, peak_flops: Optional[Mapping] = None,
                 aliases=(), **extra) -> GPUSpec:
    """Add or replace a part. Sizes may be numbers or strings (``'80GB'``, ``'3.35TB/s'``,
    ``'989.5T'``). A known part may be given in part (only the fields that change, e.g.
    ``register_gpu("h100", efficiency={"matmul_peak_fraction": 0.7})``); a new one needs
    ``memory``, ``bandwidth`` and ``peak_flops``. ``extra``: ``sm_count``, ``nvlink``,
    ``nic`` (bandwidths), ``nics_per_node``, ``gpus_per_node``, ``efficiency``, ``sources``.
    Every field is checked (type, unit, range: :mod:`.hardware_fields`); a bad one raises
    ``ValueError`` naming the part and the field.
    Returns the stored :class:`GPUSpec`; later lookups find it by any alias.
    """
    _ensure_builtin()
    row = {"memory": memory, "bandwidth": bandwidth, "peak_flops": peak_flops, "aliases": aliases, **extra}
    fields = check_row(name, row)
    base = _REGISTRY.get(_key(name))
    if base is None and not {"memory_bytes", "bandwidth_bytes_per_s", "peak_flops"} <= set(fields):
        raise HardwareFieldError(f"part {name!r} is not a known part: give memory, bandwidth and peak_flops")
    aliases = fields.pop("aliases", ())
    for attr in ("peak_flops", "efficiency", "sources"):     # merged over the known part's
        if base is not None and attr in fields:
            fields[attr] = {**getattr(base, attr), **fields[attr]}
    if not fields.get("efficiency", True):
        del fields["efficiency"]
    if base is not None and _key(base.name) == _key(name):
        spec = replace(base, aliases=tuple(dict.fromkeys((*base.aliases, *aliases))), **fields)
    else:
        spec = GPUSpec(str(name), fields.pop("memory_bytes"), fields.pop("bandwidth_bytes_per_s"),
                       fields.pop("peak_flops"), tuple(aliases), **fields)
    _store(spec)
    return spec


def _store(spec: GPUSpec) -> None:
    for alias in (spec.name, *spec.aliases):
        _REGISTRY[_key(alias)] = spec


def _ensure_builtin() -> None:
    if not _REGISTRY:
        for spec in _BUILTIN:
            _store(spec)


def _ensure_loaded() -> None:
    global _ENV_LOADED
    _ensure_builtin()
    path = os.environ.get(HARDWARE_ENV, "")
    if path and path != _ENV_LOADED:
        _load_file(path)
        _ENV_LOADED = path


def _load_file(path: str) -> None:
    """Register every part of the file, or none: one line naming the file, the part and the
    field that is wrong."""
    saved = dict(_REGISTRY)
    try:
        table = _read_table(path)
        for name, row in table.items():
            register_gpu(name, **_as_row(name, row))
    except (InputFileError, HardwareFieldError) as e:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
        raise HardwareFileError(f"{HARDWARE_ENV}={path}: {e}; fix the file (or unset {HARDWARE_ENV})") from None


_SHAPE = ('expected a JSON object of {"NAME": {"memory": "80GB", "bandwidth": "3.35TB/s", '
          '"peak_flops": {"bf16": "989.5T"}}} (a known part may give only "efficiency", "nic", ...)')


def _read_table(path: str) -> dict:
    try:
        data = read_input(path, what="hardware JSON", max_bytes=HARDWARE_MAX_BYTES)
    except InputFileError as e:
        text = str(e)
        raise InputFileError(text[len(path) + 2:] if text.startswith(f"{path}: ") else text) from None
    try:
        table = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InputFileError(f"not UTF-8 text; {_SHAPE}") from None
    except ValueError as e:
        raise InputFileError(f"not valid JSON ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                             f"{_SHAPE}") from None
    except RecursionError:
        raise InputFileError(f"nested too deep to read; {_SHAPE}") from None
    if not isinstance(table, dict):
        raise InputFileError(f"{_SHAPE}, got {type(table).__name__}")
    return table


def read_table(path: str) -> dict:
    """The parts of a file in ``TORCHLEDGER_HARDWARE``'s format, each row checked as loading
    checks it, none registered (``calibrate --output`` onto an existing file). A file that is
    not a regular JSON object of at most ``HARDWARE_MAX_BYTES`` raises ``InputFileError``, a bad
    row ``HardwareFieldError``: one line each (ValueErrors)."""
    table = _read_table(path)
    for name, row in table.items():
        check_row(name, row)
    return table


def _as_row(name, row) -> dict:
    """A part's JSON object as ``register_gpu``'s keywords: an object of known fields."""
    check_row(name, row)
    return dict(row)


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
