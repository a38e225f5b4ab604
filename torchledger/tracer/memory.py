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

import numpy as np

__all__ = ["StorageTracker", "CATEGORIES"]

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
PARAM, BUFFER, GRAD, OPT, ACT, TEMP = range(6)


class StorageTracker:
    def __init__(self):
        self.alloc: list[int] = []
        self.free: list[int] = []
        self.nbytes: list[int] = []
        self.cat: list[int] = []
        self.op: list = []                  # the op that made each storage (None: not an op)
        self.live: dict[int, int] = {}      # storage cdata -> lifetime index (while alive)
        self._refs: dict[int, object] = {}
        self.now = 0                        # ops completed so far (set by the dispatch mode)
        self.closed = False

    def add(self, storage, category: int, at: int | None = None, op=None) -> int:
        """Start tracking ``storage`` (an UntypedStorage) made by ``op`` (if an op made it);
        returns its lifetime index."""
        key = storage._cdata
        k = self.live.get(key)
        if k is not None:
            return k
        k = len(self.alloc)
        self.alloc.append(self.now if at is None else at)
        self.free.append(-1)
        self.nbytes.append(storage.nbytes())
        self.cat.append(category)
        self.op.append(op)
        self.live[key] = k
        self._refs[key] = weakref.ref(storage, lambda _r, key=key, k=k: self._freed(key, k))
        return k

    def _freed(self, key: int, k: int) -> None:
        if self.closed:
            return
        self.free[k] = self.now
        self.live.pop(key, None)
        self._refs.pop(key, None)

    def promote(self, storage, category: int, only_from: int | None = TEMP) -> int:
        """Re-categorise a tracked storage (or start tracking it now)."""
        k = self.live.get(storage._cdata)
        if k is None:
            return self.add(storage, category)
        if only_from is None or self.cat[k] == only_from:
            self.cat[k] = category
        return k

    def close(self) -> None:
        """Stop listening for frees (storages still alive stay live to the end)."""
        self.closed = True

    def alive_at_end(self) -> dict:
        """lifetime index -> weakref of each storage still alive when the step ended."""
        return {k: self._refs[key] for key, k in self.live.items() if key in self._refs}

    def release(self) -> None:
        self._refs.clear()
        self.live.clear()

    def timeline(self, n_ops: int) -> np.ndarray:
        """Live bytes per category after each op: array of shape (len(CATEGORIES), n_ops + 1).

        Column i is the memory live while op i runs (its outputs included, frees that happen
        before op i starts excluded); the last column is the end of the step.
        """
        n = n_ops + 1
        out = np.zeros((len(CATEGORIES), n + 1), dtype=np.int64)
        if self.alloc:
            alloc = np.minimum(np.asarray(self.alloc, dtype=np.int64), n - 1)
            free = np.asarray(self.free, dtype=np.int64)
            free = np.where(free < 0, n, free)
            size = np.asarray(self.nbytes, dtype=np.int64)
            cat = np.asarray(self.cat, dtype=np.int64)
            np.add.at(out, (cat, alloc), size)
            np.add.at(out, (cat, free), -size)
        return np.cumsum(out, axis=1)[:, :n]
