"""Which module is running: in forward by a hook-maintained stack, in backward by the
autograd node being executed.

Forward: global module pre/post hooks push and pop the module's index (``always_call=True``
so an exception in forward still pops). Backward: every autograd node carries the sequence
number it was given when the forward op created it. Each time the module stack changes we
note the autograd sequence counter, so the module that created a node is the innermost
module active at that counter value: one ``bisect`` per backward node, nothing per forward
op. Nodes of ``AccumulateGrad`` have no sequence number; they belong to the module that owns
their parameter.

Module hooks that fire while a backward is running are activation-checkpoint recomputation.
"""
from __future__ import annotations

import weakref
from bisect import bisect_right

import torch
from torch._C._autograd import _get_sequence_nr
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .memory import storages

__all__ = ["ModuleScope", "NO_MODULE"]

NO_MODULE = -1
_current_node = torch._C._current_autograd_node
_NO_SEQ = 2**64 - 1


def _always() -> bool:
    return True


_Module = torch.nn.Module


def _own_params(mod):
    """``mod.parameters(recurse=False)``; read off ``_parameters`` directly unless the module's
    class defines its own ``parameters``/``named_parameters``."""
    cls = type(mod)
    if cls.parameters is _Module.parameters and cls.named_parameters is _Module.named_parameters:
        return [p for p in mod._parameters.values() if p is not None]
    return mod.parameters(recurse=False)


def _storages(p) -> list:
    try:
        return storages(p)
    except Exception:       # a kind with no storage: StepTracer warns about it
        return []


class ModuleScope:
    """The module tree of one model, and which module is active now."""

    def __init__(self, model: torch.nn.Module):
        self.names: list[str] = []
        self.types: list[str] = []
        self.parents: list[int] = []
        self.own_params: list[int] = []
        self._index: dict[int, int] = {}            # id(module) -> index
        self._refs: list = []                       # weakrefs keep ids honest
        self.param_owner: dict[int, int] = {}       # id(param) -> module index
        self.storage_owner: dict[int, int] = {}     # a param's storage -> module index
        self.params: list = []                      # the model's parameters, each once, in
        by_name: dict[str, int] = {}                # ``model.parameters()`` order (taken by StepTracer)
        for name, mod in model.named_modules():
            i = len(self.names)
            self._index[id(mod)] = i
            self._refs.append(weakref.ref(mod))
            self.names.append(name)
            by_name[name] = i
            self.types.append(type(mod).__name__)
            parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
            self.parents.append(by_name[parent] if parent is not None else NO_MODULE)
            n = 0
            for p in _own_params(mod):
                if id(p) not in self.param_owner:
                    self.param_owner[id(p)] = i
                    self.params.append(p)
                    for s in _storages(p):
                        self.storage_owner.setdefault(s._cdata, i)
                    n += p.numel()
            self.own_params.append(n)
        self.ours = _always      # whether this thread's module calls are the step's (StepTracer)
        self.stack: list[int] = []
        self.calls = [0] * len(self.names)
        self.recompute_depth = 0
        self._in_bwd_flags: list[bool] = []
        self._seq: list[int] = []
        self._mod: list[int] = []
        self._node_cache: dict[int, int] = {}

    # -- hooks ---------------------------------------------------------------------------
    def install(self, undo) -> None:
        """Register the global module hooks; ``undo`` (``lifecycle.Installed.undo.append``)
        gets each handle's ``remove``."""
        undo(register_module_forward_pre_hook(self._pre).remove)
        undo(register_module_forward_hook(self._post, always_call=True).remove)

    def _pre(self, module, args):
        i = self._index.get(id(module))
        if i is None or self._refs[i]() is not module or not self.ours():
            return None
        in_bwd = _current_node() is not None
        if in_bwd:
            self.recompute_depth += 1
        self._in_bwd_flags.append(in_bwd)
        self.stack.append(i)
        self.calls[i] += 1
        self._seq.append(_get_sequence_nr())
        self._mod.append(i)
        return None

    def _post(self, module, args, output):
        i = self._index.get(id(module))
        if i is None or i not in self.stack or not self.ours():
            return None
        while self.stack:                            # unwind past frames an exception skipped
            top = self.stack.pop()
            if self._in_bwd_flags.pop():
                self.recompute_depth -= 1
            if top == i:
                break
        self._seq.append(_get_sequence_nr())
        self._mod.append(self.stack[-1] if self.stack else NO_MODULE)
        return None

    def recomputing_in(self, mod: int) -> None:
        """Checkpointed code that calls no module is being recomputed for ``mod`` (called at
        each of its ops): autograd nodes it makes (reentrant checkpoint backpropagates through
        them) belong to ``mod``. The op being dispatched already has its node, one number
        below the counter; nodes of the forward (before the last transition) keep theirs."""
        if self._mod and self._mod[-1] != mod:
            self._seq.append(max(_get_sequence_nr() - 1, self._seq[-1]))
            self._mod.append(mod)

    def owns_node(self, mod: int) -> None:
        """The autograd node of the op being dispatched (made just before it reaches a
        dispatch mode: one number below the counter) belongs to ``mod``."""
        self._node_cache[_get_sequence_nr() - 1] = mod

    # -- lookups -------------------------------------------------------------------------
    def is_ancestor(self, a: int, i: int) -> bool:
        """Module ``a`` contains module ``i`` (strictly)."""
        p = self.parents[i]
        while p >= 0:
            if p == a:
                return True
            p = self.parents[p]
        return False

    @property
    def top(self) -> int:
        return self.stack[-1] if self.stack else NO_MODULE

    def module_of_node(self, node) -> int:
        """The module whose forward created autograd ``node``."""
        seq = node._sequence_nr()
        cached = self._node_cache.get(seq)
        if cached is not None:
            return cached
        if seq == _NO_SEQ:                           # AccumulateGrad: the param's owner
            var = getattr(node, "variable", None)
            return self.param_owner.get(id(var), NO_MODULE) if var is not None else NO_MODULE
        k = bisect_right(self._seq, seq) - 1
        mod = self._mod[k] if k >= 0 else NO_MODULE
        self._node_cache[seq] = mod
        return mod

    def index_of(self, module) -> int:
        """The index of ``module`` in the tree, NO_MODULE when it is not in it."""
        i = self._index.get(id(module))
        return i if i is not None and self._refs[i]() is module else NO_MODULE

    def module(self, i: int):
        """Module ``i`` (0 is the model), None when it no longer exists or ``i`` is none."""
        return self._refs[i]() if 0 <= i < len(self._refs) else None

    def name(self, i: int) -> str:
        return self.names[i] if i >= 0 else "(no module)"
