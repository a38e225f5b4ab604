"""``torchledger snapshot FILE.pickle``: summarise a CUDA memory snapshot.

Reads any file written by ``torch.cuda.memory._dump_snapshot()`` (or by
``CudaMemoryHistory.dump``, or another tool that writes the same dict) through a restricted
unpickler that runs nothing, and prints the allocator's figures: reserved against
allocated, free blocks and fragmentation with a verdict, the largest allocations by stack,
and, where the snapshot holds a recorded history, the peak, fragmentation at the peak and
allocations never freed. ``--format json`` prints one object (``segments``,
``reserved_bytes``, ``allocated_bytes``, ``largest_free_bytes``, ``top_allocations``, ...).
"""
from __future__ import annotations

import json
import os

import click

from .types import InputError, PlainNumber, check_output

__all__ = ["snapshot"]


@click.command("snapshot")
@click.argument("file", metavar="FILE.pickle")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default=None,
              help="table for people (default), json for programs; inferred from --output's ending.")
@click.option("--top", type=PlainNumber(1, example="10"), default=10, show_default=True,
              help="How many allocation stacks to list.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write to this file instead of stdout (atomically).")
def snapshot(file: str, fmt, top: int, output) -> int:
    """Summarise a CUDA memory snapshot (FILE.pickle from torch.cuda.memory._dump_snapshot).

    Shows reserved against allocated memory, cached free blocks and fragmentation (1 -
    largest free block / free bytes), the largest allocations grouped by stack, and, if the
    snapshot holds a recorded history, the peak and the allocations never freed. The file
    is read with an unpickler that refuses anything but plain data, so a crafted pickle
    cannot run code.
    """
    from ..analyzers.snapshot import SnapshotError, check_snapshot, load_snapshot, summarize_snapshot  # lazy: CLI startup

    check_output(output)
    if fmt is None:
        fmt = "json" if output and output.lower().endswith(".json") else "table"
    try:
        snap = load_snapshot(file)
    except SnapshotError as e:
        raise InputError(str(e)) from None
    summary = summarize_snapshot(snap, top=top)
    findings = check_snapshot(summary)
    summary["file"] = file
    summary["findings"] = [f.to_dict() for f in findings]
    text = json.dumps(summary, indent=2) + "\n" if fmt == "json" else render(summary, findings)
    if output:
        from ..render.output import write_atomic  # lazy: CLI startup
        try:
            write_atomic(output, text)
        except OSError as e:
            raise InputError(f"cannot write {output}: {e.strerror or e}") from None
        click.echo(f"wrote {os.path.abspath(output)}", err=True)
    else:
        click.echo(text, nl=False)
    return 0


def _b(n) -> str:
    from ..units import fmt_bytes  # lazy: CLI startup
    return "-" if n is None else fmt_bytes(n, binary=True)


def verdict(fig: dict) -> str:
    """One sentence on the free blocks of a summary (or of its peak)."""
    from ..analyzers.snapshot import DEFAULT_OPTIONS as o  # lazy: CLI startup
    free, largest = fig["free_bytes"], fig["largest_free_bytes"]
    if not free:
        return "no cached free memory: every reserved byte is in use"
    if fig["fragmentation"] >= o["fragmentation"]:
        small = f" (little: under {_b(o['min_free_bytes'])}, so no finding)" if free < o["min_free_bytes"] else ""
        return (f"fragmented: {_b(free)} cached free, but no allocation above {_b(largest)} "
                f"fits without a new cudaMalloc{small}")
    return f"healthy: the largest free block holds {1 - fig['fragmentation']:.0%} of the free memory"


def render(summary: dict, findings) -> str:
    """The table for people: figures, verdict, per device, top stacks, history, findings."""
    from tabulate import tabulate

    s = summary
    kinds = s["segment_types"]
    rows = [("file", s.get("file", "")),
            ("segments", f"{s['segments']} ({kinds['large']} large, {kinds['small']} small) "
                         f"on {len(s['devices'])} device(s)"),
            ("reserved", _b(s["reserved_bytes"])),
            ("allocated", f"{_b(s['allocated_bytes'])} requested, {_b(s['allocated_block_bytes'])} in blocks"),
            ("pending free", _b(s["pending_free_bytes"])),
            ("free (cached)", f"{_b(s['free_bytes'])} in {s['free_blocks']} blocks; "
                              f"largest {_b(s['largest_free_bytes'])}"),
            ("fragmentation", f"{s['fragmentation']:.2f}: {verdict(s)}")]
    out = ["CUDA memory snapshot", tabulate(rows, tablefmt="plain"), ""]
    if len(s["devices"]) > 1 or len(s["streams"]) > 1:
        cols = ["device", "stream", "segments", "reserved_bytes", "allocated_bytes", "free_bytes",
                "largest_free_bytes", "fragmentation"]
        out += [tabulate([[r[c] if "bytes" not in c else _b(r[c]) for c in cols] for r in s["streams"]],
                         headers=[c.replace("_bytes", "") for c in cols], floatfmt=".2f"), ""]
    if s["top_allocations"]:
        out += [f"Largest allocations by stack (top {len(s['top_allocations'])})",
                tabulate([[_b(g["size"]), g["count"], _b(g["requested_size"]), g["location"] or "<no stack>"]
                          for g in s["top_allocations"]],
                         headers=["size", "count", "requested", "allocated at"]), ""]
    for h in s["history"]:
        p = h["peak"]
        nf = h["never_freed"]
        out += [f"History, device {h['device']}: {h['entries']} events",
                tabulate([("at start", f"{_b(h['start']['allocated_bytes'])} allocated, "
                                       f"{_b(h['start']['reserved_bytes'])} reserved"),
                          ("peak", f"{_b(p['allocated_bytes'])} allocated, {_b(p['reserved_bytes'])} "
                                   f"reserved at event {p['index']} ({p['location'] or 'no stack'})"),
                          ("free at peak", f"{_b(p['free_bytes'])} in {p['free_blocks']} blocks; largest "
                                           f"{_b(p['largest_free_bytes'])}; fragmentation "
                                           f"{p['fragmentation']:.2f} (approximate)"),
                          ("max reserved", _b(h["max_reserved_bytes"])),
                          ("never freed", f"{nf['count']} allocations, {_b(nf['bytes'])}"),
                          ("OOMs", str(len(h["ooms"])))], tablefmt="plain"), ""]
    if not s["segments"] and not s["history"]:
        out += ["The snapshot is empty: no segments and no history (was anything allocated on CUDA?)", ""]
    out.append("Findings" if findings else "No findings.")
    for f in findings:
        where = f" [{f.location}]" if f.location else ""
        out.append(f"  {f.severity:<7} {f.rule} {f.message}{where}")
        if f.hint:
            out.append(f"          hint: {f.hint}")
    return "\n".join(out) + "\n"
