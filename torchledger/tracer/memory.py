"""Live memory from storage lifetimes, on any device (CPU, CUDA, meta, fake).

Every storage the step allocates is noted with the index of the op that made it; a weakref
callback notes the op index at which it is freed. Storages that exist before the step
(parameters, buffers, gradients, optimizer state) are live from index 0. Each storage has a
category that later evidence can refine: a forward temporary becomes an *activation* when
autograd saves it, a backward temporary becomes a *gradient* when it lands in ``.grad``, an
optimizer-phase temporary becomes *optimizer state* when the optimizer keeps it. The
timeline is computed once, after the step, from those lifetimes with their final
categories, so a peak inside the optimizer's first step shows the state it allocated as
state, not as temporaries.

Known limitations: storages allocated before the step that the model does not own (the
input batch) are counted only from the moment autograd saves them; memory that the
allocator holds but no tensor uses (CUDA cache, fragmentation) is not here: see the CUDA
figures recorded at phase boundaries.
"""
from __future__ import annotations

import weakref
from collections import deque

import numpy as np
import torch

__all__ = ["StorageTracker", "CATEGORIES", "ALL_CATEGORIES", "data_tensors", "storages", "tensor_bytes", "state_tensors"]

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
PARAM, BUFFER, GRAD, OPT, ACT, TEMP = range(6)
#: Distributed steps add one: the parameters FSDP all-gathers for forward and backward (the
#: local shards stay "parameters"); a record names it only when it held bytes (build.py), so
#: single-process records keep the six above.
UNSHARDED = 6
ALL_CATEGORIES = CATEGORIES + ("unsharded_params",)


def _plain_types() -> frozenset:
    """Tensor classes that hold their data themselves (FakeTensor too: its fake storage)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor})


PLAIN = _PLAIN = _plain_types()
_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
               torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def data_tensors(t, depth: int = 0) -> list:
    """The strided tensors that hold ``t``'s data: ``t`` itself; a sparse tensor's indices and
    values; the inner tensors of a wrapper subclass (DTensor's local shard, a jagged nested
    tensor's values and offsets). Raises for a kind whose data cannot be reached."""
    if type(t) in _PLAIN and t.layout is torch.strided:      # the common case, and fast
        return [t]
    layout = t.layout
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in _COMPRESSED:
        a, b = _COMPRESSED[layout]
        return [getattr(t, a)(), getattr(t, b)(), t.values()]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and depth < 8:
        inner = [getattr(t, name) for name in flatten()[0]]
        return [x for i in inner if isinstance(i, torch.Tensor) for x in data_tensors(i, depth + 1)]
    return [t]


def storages(t) -> list:
    """The ``UntypedStorage`` objects holding ``t``'s data (see ``data_tensors``)."""
    if type(t) in _PLAIN and t.layout is torch.strided:
        return [t.untyped_storage()]
    return [x.untyped_storage() for x in data_tensors(t)]


def tensor_bytes(t) -> int:
    """Bytes of ``t``'s data: a sparse tensor's indices plus values, not its dense size."""
    if type(t) in _PLAIN and t.layout is torch.strided:
        return t.nbytes
    return sum(x.nbytes for x in data_tensors(t))


def state_tensors(opt, limit: int = 100_000):
    """(key, tensor) for every tensor in an optimizer's state, also inside lists, tuples and
    dicts (LBFGS keeps its history in lists); each tensor once."""
    seen: set = set()
    todo: deque = deque()
    for state in list(opt.state.values()):
        if isinstance(state, dict):
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and not todo:    # the common case (AdamW's
                    if id(v) not in seen:                       # tensors): no queue needed while
                        seen.add(id(v))                         # nothing waits before it
                        limit -= 1
                        yield k, v
                else:
                    todo.append((k, v, 0))
    while todo and limit > 0:               # breadth first: a tensor is named by its first key
        key, v, depth = todo.popleft()
        limit -= 1
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                yield key, v
        elif isinstance(v, (list, tuple)) and depth < 8:
            todo.extend((key, x, depth + 1) for x in v)
        elif isinstance(v, dict) and depth < 8:
            todo.extend((key, x, depth + 1) for x in list(v.values()))


class StorageTracker:
    """Storage lifetimes of one step.

    NB: a storage's death is noted by a weakref callback that is a C function (``list.append``
    of the dead weakref), applied by ``drain`` before the next lookup or op. A Python callback
    would be a function entry where Python delivers a pending Ctrl-C, and the interpreter
    swallows exceptions raised in weakref callbacks ("Exception ignored in ..."): the
    user's KeyboardInterrupt would be lost.
    """

    def __init__(self):
        self.alloc: list[int] = []
        self.free: list[int] = []
        self.nbytes: list[int] = []
        self.cat: list[int] = []
        self.op: list = []                  # the op that made each storage (None: not an op)
        self.made: dict = {}                # lifetime index -> weakref(s) of the tensors ops returned on it
        self.live: dict[int, int] = {}      # storage cdata -> lifetime index (while alive)
        self._refs: dict[int, object] = {}
        self._owner: dict[int, int] = {}    # id(weakref) -> lifetime index (no tuple per storage:
        self.keys: list[int] = []           # lifetime index -> storage cdata   each feeds the gc)
        self.dead: list = []                # weakrefs whose storage died, not yet drained
        self._died = self.dead.append       # the weakref callback: C, made once
        self.now = 0                        # ops completed so far (set by the dispatch mode)
        self.closed = False

    def add(self, storage, category: int, at: int | None = None, op=None, tensor=None) -> int:
        """Start tracking ``storage`` (an UntypedStorage) made by ``op`` (if an op made it, as
        the storage of its output ``tensor``); returns its lifetime index."""
        if self.dead:
            self.drain()
        key = storage._cdata
        k = self.live.get(key)
        if k is not None:
            if tensor is not None:          # another tensor on it (``_unsafe_view``, in place)
                self._made_by(k, tensor)
            return k
        k = len(self.alloc)
        self.alloc.append(self.now if at is None else at)
        self.free.append(-1)
        self.nbytes.append(storage.nbytes())
        self.cat.append(category)
        self.op.append(op)
        self.keys.append(key)
        self.live[key] = k
        ref = weakref.ref(storage, self._died)
        self._refs[key] = ref
        self._owner[id(ref)] = k
        if tensor is not None:
            self.made[k] = weakref.ref(tensor)
        return k

    def _made_by(self, k: int, tensor) -> None:
        """Note ``tensor`` among the (at most 4 live) tensors ops returned on lifetime ``k``
        (one weakref, or a list of them once there are two)."""
        refs = self.made.get(k)
        if refs is None:
            self.made[k] = weakref.ref(tensor)
        elif type(refs) is not list:
            if refs() is not tensor:
                self.made[k] = [refs, weakref.ref(tensor)] if refs() is not None else weakref.ref(tensor)
        elif refs[-1]() is not tensor:
            refs[:] = [r for r in refs if r() is not None][-3:]
            refs.append(weakref.ref(tensor))

    def made_refs(self, k: int) -> list:
        """Weakrefs of the tensors ops returned on lifetime ``k`` (see ``_made_by``)."""
        refs = self.made.get(k)
        return [] if refs is None else refs if type(refs) is list else [refs]

    def drain(self) -> None:
        """Note the storages that died since the last call as freed now (before ``now``
        moves on: the dispatch mode calls this before it counts the next op)."""
        dead = self.dead
        while dead:
            ref = dead.pop()
            k = self._owner.pop(id(ref), None)
            if k is None or self.closed or self.free[k] >= 0:   # already freed by a resize to 0
                continue
            key = self.keys[k]
            self.free[k] = self.now
            if self.live.get(key) == k:
                del self.live[key]
            if self._refs.get(key) is ref:
                del self._refs[key]

    def resized(self, storage, category: int) -> None:
        """``storage.resize_()`` ran (FSDP frees and re-allocates its unsharded parameters
        that way, keeping the storage object): the old size's lifetime ends now and, when the
        storage still has bytes, a new one of ``category`` starts."""
        if self.dead:
            self.drain()
        key = storage._cdata
        k = self.live.pop(key, None)
        if k is not None:
            self.free[k] = self.now
            self._refs.pop(key, None)
        if storage.nbytes():
            self.add(storage, category)

    def promote(self, storage, category: int, only_from: int | None = TEMP) -> int:
        """Re-categorise a tracked storage (or start tracking it now)."""
        if self.dead:
            self.drain()
        k = self.live.get(storage._cdata)
        if k is None:
            return self.add(storage, category)
        if only_from is None or self.cat[k] == only_from:
            self.cat[k] = category
        return k

    def close(self) -> None:
        """Stop listening for frees (storages still alive stay live to the end)."""
        self.drain()
        self.closed = True

    def alive_at_end(self) -> dict:
        """lifetime index -> weakref of each storage still alive when the step ended."""
        return {k: self._refs[key] for key, k in self.live.items() if key in self._refs}

    def release(self) -> None:
        self.made.clear()
        self._refs.clear()
        self.live.clear()
        self._owner.clear()
        self.dead.clear()

    def timeline(self, n_ops: int) -> np.ndarray:
        """Live bytes per category after each op: array of shape (len(ALL_CATEGORIES), n_ops + 1).

        Column i is the memory live while op i runs (its outputs included, frees that happen
        before op i starts excluded); the last column is the end of the step.
        """
        n = n_ops + 1
        out = np.zeros((len(ALL_CATEGORIES), n + 1), dtype=np.int64)
        if self.alloc:
            alloc = np.minimum(np.asarray(self.alloc, dtype=np.int64), n - 1)
            free = np.asarray(self.free, dtype=np.int64)
            free = np.where(free < 0, n, free)
            size = np.asarray(self.nbytes, dtype=np.int64)
            cat = np.asarray(self.cat, dtype=np.int64)
            np.add.at(out, (cat, alloc), size)
            np.add.at(out, (cat, free), -size)
        return np.cumsum(out, axis=1)[:, :n]
