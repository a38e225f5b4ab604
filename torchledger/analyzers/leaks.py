"""Leaks over several traced steps (a ``Ledger``'s leak window of recent traced steps, or
``audit --steps``).

* TL-LEAK-001 (warning): live bytes at the end of each step grow step after step over three
  or more steps after the first (warm-up: it allocates the optimizer state), by at least
  ``leak_min_bytes`` (default 1 KiB) a step: a detached scalar kept per step is not a leak
  worth a warning, a kept graph is caught by TL-LEAK-002 whatever its size;
* TL-LEAK-002 (warning): tensors made in step k and still alive at the end of step k+1 that
  hold an autograd graph (``losses.append(loss)``), named by their creation site; "alive" is
  read from a weak reference after one ``gc.collect()`` (``tracer.retention``), so storages
  held only by garbage (a reference cycle) are not blamed on the user;
* TL-LEAK-003 (warning): gradients never cleared: an optimizer step left the gradients in
  place and the next step's backward accumulated into them;
* TL-LEAK-004 (warning): a module attribute (a list or dict) that holds more tensors after
  every step.

No finding for gradient accumulation, ``loss.item()`` logging, ``zero_grad`` in any form, or
the first step allocating optimizer state.
"""
from __future__ import annotations

from ..record import Finding

__all__ = ["check_leaks", "end_bytes"]


def end_bytes(record) -> int:
    return sum(record.memory.get("end_breakdown", {}).values())


def check_leaks(records, options=None) -> list:
    recs = [r for r in records if r.memory.get("end_breakdown")]
    if len(recs) < 2:
        return []
    out = []
    out += _growth(recs, int((options or {}).get("leak_min_bytes", 1024)))
    out += _kept_graphs(recs[-1])
    out += _uncleared_grads(recs)
    out += _module_caches(recs)
    return out


def _growth(recs, min_bytes: int) -> list:
    after = recs[1:]
    if len(after) < 3:
        return []
    totals = [end_bytes(r) for r in after]
    deltas = [b - a for a, b in zip(totals, totals[1:])]
    if not all(d > 0 for d in deltas):
        return []
    per_step = sum(deltas) / len(deltas)
    if per_step < min_bytes:
        return []
    cats = after[0].memory["end_breakdown"]
    grew = [c for c in cats if after[-1].memory["end_breakdown"].get(c, 0) > cats.get(c, 0)]
    seen = dict.fromkeys(_site(g) for g in after[-1].memory.get("retained", []))
    sites = ", ".join(list(seen)[:3])           # one entry per site, not one per step
    return [Finding("TL-LEAK-001", "warning",
                    f"live memory grows {per_step:,.0f} bytes per step since step "
                    f"{after[0].meta.get('step_index')} ({', '.join(grew)})"
                    + (f"; kept from earlier steps: {sites}" if sites else ""),
                    measured=per_step, expected=0,
                    hint="keep loss.item() rather than the loss; detach() what you keep")]


def _site(g: dict) -> str:
    """``file:line (op)``, else ``module (op)``; the root module (named "") is ``(root)``."""
    module = g.get("module")
    where = g.get("location") or ("(root)" if module == "" else module) or "?"
    return f"{where} ({g['op']})" if g.get("op") else where


def _kept_graphs(rec) -> list:
    sites: dict = {}
    for g in rec.memory.get("retained", []):
        if g.get("holds_graph") and g.get("age_steps", 0) >= 1:
            s = sites.setdefault((g.get("location"), g.get("op"), g.get("module")),
                                 {"steps": [], "count": 0, "bytes": 0})
            s["steps"].append(g["step"])
            s["count"] += g["count"]
            s["bytes"] += g["bytes"]
    out = []
    for (location, op, module), s in sites.items():
        steps = sorted(s["steps"])
        out.append(Finding("TL-LEAK-002", "warning",
                           f"{s['count']} tensor(s) made by {op} in step(s) "
                           f"{', '.join(map(str, steps))} are still alive at the end of step "
                           f"{rec.meta.get('step_index')} with their autograd graph "
                           f"({s['bytes']:,} bytes of storage)", module=module, location=location,
                           measured=s["bytes"], expected=0,
                           hint="store loss.item() or loss.detach(), not the loss itself"))
    return out


def _uncleared_grads(recs) -> list:
    for prev, cur in zip(recs, recs[1:]):
        if cur.meta.get("step_index") != (prev.meta.get("step_index") or 0) + 1:
            continue
        pg, cg = prev.memory.get("grads", {}), cur.memory.get("grads", {})
        if pg.get("optimizer_steps") and pg.get("left_after_optimizer_bytes") and cg.get("at_backward_bytes"):
            return [Finding("TL-LEAK-003", "warning",
                            f"gradients were not cleared after the optimizer step of step "
                            f"{prev.meta.get('step_index')}: step {cur.meta.get('step_index')}'s backward "
                            f"accumulated into {cg['at_backward_bytes']:,} bytes of old gradients",
                            measured=cg["at_backward_bytes"], expected=0,
                            hint="call optimizer.zero_grad(set_to_none=True) after optimizer.step()")]
    return []


def _module_caches(recs) -> list:
    after = recs[1:] if len(recs) > 2 else recs
    series: dict = {}
    for r in after:
        for c in r.memory.get("module_caches", []):
            series.setdefault((c["module"], c["attr"]), []).append(c["tensors"])
    out = []
    for (module, attr), counts in series.items():
        if len(counts) == len(after) and len(counts) >= 2 and all(b > a for a, b in zip(counts, counts[1:])):
            out.append(Finding("TL-LEAK-004", "warning",
                               f"{module or '(root)'}.{attr} holds more tensors after every step "
                               f"({' -> '.join(map(str, counts))})", module=module,
                               measured=counts[-1], expected=counts[0],
                               hint="clear or bound the cache, or store detached copies"))
    return out
