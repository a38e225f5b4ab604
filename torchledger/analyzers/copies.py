"""Copies: where bytes were materialised, and which of those copies were needless.

``copy_table(record)`` groups the copy events by source line and module with count, bytes and
share of the step's bytes moved. ``check_copies`` flags the needless ones:

* TL-COPY-001 (warning): a dtype round trip (a -> b and b -> a in the same module);
* TL-COPY-002 (warning): the same device move repeated within one step at one line;
* TL-COPY-003 (warning): a ``.contiguous()``/``reshape`` copy of a transposed or permuted
  tensor that is permuted again afterwards (the copy bought nothing);
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
    casts: dict = {}
    for c in copies:
        r = c["reason"]
        if "dtype " in r:
            pair = r.split("dtype ", 1)[1]
            a, b = pair.split("->")
            casts.setdefault(c.get("module"), []).append((a, b, c))
    out = []
    for module, items in casts.items():
        seen = {(a, b) for a, b, _ in items}
        for a, b, c in items:
            if (b, a) in seen and _rank(a) > _rank(b):      # report once, at the narrowing cast
                back = next(x for x in items if (x[0], x[1]) == (b, a))[2]
                out.append(Finding("TL-COPY-001", "warning",
                                   f"dtype round trip {a} -> {b} -> {a} ({c['bytes'] + back['bytes']:,} "
                                   f"bytes copied)", module=module, location=c.get("location"),
                                   measured=c["bytes"] + back["bytes"], expected=0,
                                   hint=f"keep the tensor in one dtype (the cast back is at "
                                        f"{back.get('location')})"))
    return out


def _rank(dtype: str) -> int:
    return {"float64": 5, "float32": 4, "bfloat16": 3, "float16": 3}.get(dtype, 0)
