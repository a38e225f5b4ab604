"""What outlives a step: storages kept across steps, gradients left uncleared, module caches.

Run once at the end of a traced step. Storages the step's ops made (temporaries and
activations) that are still alive become the ``carry`` a ``Ledger`` hands to the next
traced step, with their origin (step, op, module, user line for loss-like scalars) and weak
references to the tensors ops returned on it. A storage that arrives through the carry and is still
alive at the end of the next step was kept across steps: the leak analyzer reads
``memory["retained"]``; it holds an autograd graph when one of those tensors is alive with
a ``grad_fn``. The work is bounded by the step's own storages, never by the Python heap: no
``gc.get_objects()`` walk, and when a carried storage is still alive one collection of the
young generations (objects made since the last steps), not of the whole heap.

Known limitations: a storage held only by a reference cycle that Python's collector has
already moved to its oldest generation counts as retained until that collector runs (the
leak rules need steady growth over several steps, which such a cycle does not keep up); a
graph kept through a tensor that no op returned on the storage (a view made by an alias op)
is found when that tensor keeps one of them alive (a view keeps its base).
"""
from __future__ import annotations

import gc
import weakref

import torch

from .phases import PHASES
from .memory import ACT, TEMP

__all__ = ["retention"]

_PRIVATE = {"_parameters", "_buffers", "_modules"}


def retention(tracer, model, record) -> None:
    """Fill ``record.memory`` retained/grads/module_caches and ``tracer.carry_out``."""
    st = tracer.storages
    carried = tracer._carried
    alive = {k: ref for k, ref in st.alive_at_end().items()
             if st.cat[k] in (TEMP, ACT) and ref() is not None}
    if any(k in carried for k in alive):
        # a storage kept since an earlier step may be held only by a reference cycle that
        # gc would free: collect the young generations once (only when something was kept;
        # bounded by what was allocated lately, not by the heap) and look again
        gc.collect(1)
        alive = {k: ref for k, ref in alive.items() if ref() is not None}
    retained, new_count, new_bytes = {}, 0, 0
    for k, ref in alive.items():
        storage = ref()
        if storage is None:
            continue
        origin = tracer._carried.get(k)
        if origin is None:
            origin = _origin(tracer, k)
            new_count += 1
            new_bytes += st.nbytes[k]
        else:
            key = (origin["step"], origin["op"], origin["module"], origin["location"])
            g = retained.setdefault(key, dict(origin, count=0, bytes=0, holds_graph=False,
                                              age_steps=tracer.step_index - origin["step"]))
            g["count"] += 1
            g["bytes"] += st.nbytes[k]
            if not g["holds_graph"] and _holds_graph(tracer._carried_tensor.get(k)):
                g["holds_graph"] = True
        # a plain weakref: the tracker's (whose callback holds the whole tracker) stays here
        tracer.carry_out[storage._cdata] = {"ref": weakref.ref(storage), "category": st.cat[k],
                                            "origin": origin,
                                            "tensor": st.made_refs(k) or tracer._carried_tensor.get(k)}
        del storage
    record.memory["retained"] = sorted(retained.values(), key=lambda g: -g["bytes"])
    record.memory["retained_new"] = {"count": new_count, "bytes": new_bytes}
    record.memory["grads"] = _grads(tracer)
    record.memory["module_caches"] = _module_caches(model) if model is not None else []


def _origin(tracer, k: int) -> dict:
    """Where storage ``k`` (made in this step) was made: step, op, module, phase, user line."""
    st, mode, scope = tracer.storages, tracer.mode, tracer.scope
    i = st.alloc[k]
    op = st.op[k]
    return {"step": tracer.step_index, "op": str(op) if op is not None else None,
            "module": scope.name(mode.op_module[i]) if i < len(mode.op_module) else None,
            "phase": PHASES[mode.op_phase[i]] if i < len(mode.op_phase) else None,
            "location": mode.scalar_sites.get(i)}


def _holds_graph(refs) -> bool:
    """A tensor behind the weakrefs ``refs`` (those ops returned on the storage) is alive
    with a ``grad_fn``."""
    for ref in refs or ():
        t = ref()
        try:
            if t is not None and t.grad_fn is not None:
                return True
        except Exception:   # a tensor kind without autograd metadata
            continue
    return False


def _grads(tracer) -> dict:
    left = 0
    current = {s._cdata for p in tracer._params if p.grad is not None
               for s in tracer._storages(p.grad, "gradient")}
    for key, nbytes in tracer._grads_after_step.items():
        if key in current and key not in tracer.mode.zeroed:
            left += nbytes
    return {"at_backward_bytes": tracer.grad_bytes_at_backward,
            "left_after_optimizer_bytes": left, "optimizer_steps": tracer.optimizer_steps}


def _module_caches(model) -> list:
    """Tensors held in list/tuple/dict attributes of the model's modules."""
    out = []
    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if not isinstance(value, (list, tuple, dict)) or not value or attr in _PRIVATE:
                continue                # NB: most are a module's empty hook dicts
            items = value.values() if isinstance(value, dict) else value
            tensors = [t for t in items if isinstance(t, torch.Tensor)]
            if tensors:
                out.append({"module": name, "attr": attr, "tensors": len(tensors),
                            "bytes": sum(t.nbytes for t in tensors)})
    return out
