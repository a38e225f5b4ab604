"""Interconnect figures and the time collectives take: NVLink per GPU and the node's
scale-out network (InfiniBand) per part, one direction, and the NCCL-tests bus-bandwidth
convention (bus bytes / bus bandwidth). Pure arithmetic, no torch; the check that uses it
is :mod:`torchledger.analyzers.interconnect` (TL-NET-001).

    >>> comm_seconds(450e9, link_bandwidth(get_link("h100"), 8)[0])
    1.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from .hardware import get_gpu

__all__ = ["LinkSpec", "LINKS", "get_link", "link_bandwidth", "comm_seconds", "compute_seconds",
           "DEFAULT_MFU"]

#: MFU assumed for the compute time when ``--mfu`` is not given (large runs see 0.3-0.6).
DEFAULT_MFU = 0.4
_GB = 1e9


@dataclass(frozen=True)
class LinkSpec:
    """A part's interconnect, in bytes/s, one direction."""

    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (half the vendor's bidirectional figure)."""
    node_network_bytes_per_s: float
    """The node's scale-out network, all NICs together, one direction."""
    gpus_per_node: int
    source: str
    """Where the figures come from."""


#: Keyed by ``hardware.GPUSpec.name``. NVLink: per GPU, one direction; network: per node
#: (8 GPUs, one NIC each in NVIDIA's DGX reference systems), one direction.
LINKS = {
    "V100 SXM": LinkSpec(150 * _GB, 50 * _GB, 8, "NVLink 2 (6 x 25 GB/s); DGX-1 4 x EDR 100 Gb/s"),
    "A100 SXM": LinkSpec(300 * _GB, 200 * _GB, 8, "NVLink 3 (12 x 25 GB/s); DGX A100 8 x HDR 200 Gb/s"),
    "H100 SXM": LinkSpec(450 * _GB, 400 * _GB, 8, "NVLink 4 (18 x 25 GB/s); DGX H100 8 x NDR 400 Gb/s"),
    "H200 SXM": LinkSpec(450 * _GB, 400 * _GB, 8, "NVLink 4 (18 x 25 GB/s); DGX H200 8 x NDR 400 Gb/s"),
    "B200 SXM": LinkSpec(900 * _GB, 400 * _GB, 8, "NVLink 5 (18 x 50 GB/s); DGX B200 8 x NDR 400 Gb/s"),
}


def get_link(gpu) -> Optional[LinkSpec]:
    """The interconnect of a part (a name or a ``GPUSpec``), or None when the table has none."""
    return LINKS.get(get_gpu(gpu).name)


def link_bandwidth(link: LinkSpec, world_size: int) -> tuple:
    """``(bytes/s, which)``: the bus bandwidth one rank's ring traffic gets at ``world_size``."""
    if world_size <= link.gpus_per_node:
        return link.nvlink_bytes_per_s, "NVLink, one node"
    bw = min(link.nvlink_bytes_per_s, link.node_network_bytes_per_s)
    nodes = -(-world_size // link.gpus_per_node)
    which = "InfiniBand per node" if bw < link.nvlink_bytes_per_s else "NVLink"
    return bw, f"{which}, ring across {nodes} nodes"


def comm_seconds(bytes_sent: float, bandwidth_bytes_per_s: float) -> float:
    """Seconds to send ``bytes_sent`` (bus bytes) at a bus bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
    return bytes_sent / bandwidth_bytes_per_s


def compute_seconds(flops: float, peak_flops: float, mfu: float) -> float:
    """Seconds for ``flops`` at ``mfu`` of ``peak_flops``."""
    if peak_flops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"need peak_flops > 0 and 0 < mfu <= 1, got {peak_flops}, {mfu}")
    return flops / (peak_flops * mfu)
