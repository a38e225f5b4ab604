"""Copies: where bytes were materialised, and which of those copies were needless.

``copy_table(record)`` groups the copy events by source line and module with count, bytes and
share of the step's bytes moved. ``check_copies`` flags the needless ones:

* TL-COPY-001 (warning): a dtype round trip by data flow: a cast b -> a that reads the output
  of a cast a -> b (``x.to(bf16).to(fp32)``); a norm that computes in fp32 and casts its
  result back is not one;
* TL-COPY-002 (warning): the same device move repeated within one step at one line;
* TL-COPY-003 (warning): a ``.contiguous()``/``reshape`` copy of a transposed or permuted
  tensor that is permuted back to the layout it was copied from (the copy bought nothing;
  copies of expanded tensors, which must be materialised, are never flagged);
* TL-COPY-004 (info): copies that move more than ``copy_share`` (default 10%) of the
  step's bytes.
"""
from __future__ import annotations

from ..record import Finding

__all__ = ["copy_table", "check_copies"]


def copy_table(record) -> list:
    """Copies grouped by (location, module): count, bytes, share of bytes moved, reasons."""
    moved = max(record.totals.get("bytes_read", 0) + record.totals.get("bytes_written", 0), 1)
    groups: dict = {}
    for c in record.copies:
        g = groups.setdefault((c.get("location"), c.get("module")),
                              {"location": c.get("location"), "module": c.get("module"), "count": 0,
                               "bytes": 0, "reasons": []})
        g["count"] += c["count"]
        g["bytes"] += c["bytes"]
        if c["reason"] not in g["reasons"]:
            g["reasons"].append(c["reason"])
    rows = sorted(groups.values(), key=lambda g: -g["bytes"])
    for g in rows:
        g["share"] = g["bytes"] / moved
    return rows


def check_copies(records, options=None) -> list:
    if not records:
        return []
    rec = records[-1]
    opts = options or {}
    out = []
    fwd = [c for c in rec.copies if c.get("phase") != "backward"]
    out += _round_trips(fwd)
    for c in fwd:
        if c["reason"].startswith(("device", "copy_ device")) and c["count"] > 1:
            out.append(Finding("TL-COPY-002", "warning",
                               f"the same device move ran {c['count']} times in one step "
                               f"({c['reason']}, {c['bytes']:,} bytes)", module=c.get("module"),
                               location=c.get("location"), measured=c["count"], expected=1,
                               hint="move the tensor once, outside the step (or cache it on the device)"))
        if c.get("permuted_back"):
            out.append(Finding("TL-COPY-003", "warning",
                               f"a contiguous copy of a permuted tensor ({c['bytes']:,} bytes, strides "
                               f"{c.get('src_stride')}) is permuted again afterwards: the copy bought nothing",
                               module=c.get("module"), location=c.get("location"), measured=c["bytes"],
                               expected=0, hint="drop the .contiguous()/.reshape() and the permute back; "
                               "keep working on the view"))
    share = float(opts.get("copy_share", 0.10))
    for g in copy_table(rec):
        if g["share"] > share:
            out.append(Finding("TL-COPY-004", "info",
                               f"copies here move {g['share']:.1%} of the step's bytes "
                               f"({g['count']} copies, {g['bytes']:,} bytes: {', '.join(g['reasons'])})",
                               module=g["module"], location=g["location"], measured=g["share"],
                               expected=share, hint="check whether a view would do"))
    return out


def _round_trips(copies) -> list:
    """TL-COPY-001: casts that read the output of a cast the other way (``round_trip`` is
    set by the tracer by data flow: the cast back's input is the first cast's output)."""
    out = []
    for c in copies:
        trip = c.get("round_trip")
        if not trip or not trip.get("events"):
            continue
        back = c["reason"].split("dtype ", 1)[-1]           # "bf16->fp32": the cast back
        b, a = back.split("->") if "->" in back else ("?", "?")
        first_loc = (trip.get("from") or [None])[0]
        out.append(Finding("TL-COPY-001", "warning",
                           f"dtype round trip {a} -> {b} -> {a}: a cast back reads the cast's own "
                           f"output ({trip['events']} time(s), {trip['bytes']:,} bytes copied)",
                           module=c.get("module"), location=first_loc or c.get("location"),
                           measured=trip["bytes"], expected=0,
                           hint=f"keep the tensor in one dtype (the cast back is at {c.get('location')})"))
    return out

