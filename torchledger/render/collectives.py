"""The "Collectives" section of the text report: only for a record of a distributed step.

    >>> print("\\n".join(collective_lines(record)))

A single-process record has no collectives and gets no section (its report is unchanged).
"""
from __future__ import annotations

from tabulate import tabulate

from ..units import fmt_bytes
from .steptime import fmt_seconds

__all__ = ["collective_lines"]

_HEADERS = ["op", "phase", "module", "group", "calls", "sent", "bus bytes", "location"]
_ROWS = 10


def collective_lines(record, top: int = _ROWS) -> list:
    """Comm bytes per phase and the largest collectives (``top`` rows), or [] without any."""
    rows = getattr(record, "collectives", None) or []
    comm = record.totals.get("comm_bytes")
    if not rows and not (comm or {}).get("total"):
        return []            # one process: comm_bytes are zeros, no section
    t = record.totals
    where = (f"rank {t['rank']} of {t['world_size']}" if t.get("world_size") is not None
             and t.get("rank") is not None else "this rank")
    mesh = t.get("mesh")
    if mesh:
        where += f", mesh {'x'.join(str(d) for d in mesh)}"
    out = ["", f"collectives ({where}; sent = bytes this rank sends, bus = NCCL-tests bus bytes):"]
    if comm:
        out.append("  comm per step: " + ", ".join(f"{k} {fmt_bytes(comm.get(k, 0), binary=True)}"
                                                  for k in ("forward", "backward", "optimizer", "other", "total")))
    cells = []
    timed = any("predicted_seconds" in c for c in rows)        # audit --gpu
    for c in sorted(rows, key=lambda c: -c.get("bytes", 0))[:top]:
        module = c.get("module")
        cells.append([c["op"], c.get("phase", "?"), "-" if module is None else module or "(root)",
                      c.get("group_size", "?"), c.get("count", 0), fmt_bytes(c.get("bytes", 0), binary=True),
                      fmt_bytes(c["bus_bytes"], binary=True) if c.get("bus_bytes") is not None else "-",
                      c.get("location") or "-"] + ([_secs(c.get("predicted_seconds"))] if timed else []))
    if cells:
        table = tabulate(cells, headers=_HEADERS + (["pred time"] if timed else []), tablefmt="simple",
                         disable_numparse=True)
        out += ["  " + line for line in table.splitlines()]
    if len(rows) > top:
        out.append(f"  ... {len(rows) - top} more in record.collectives")
    return out


def _secs(s) -> str:
    return fmt_seconds(s)
