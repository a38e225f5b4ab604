"""Record the CUDA caching allocator's history around a block of code.

    from torchledger.tracer.cuda_history import CudaMemoryHistory
    with CudaMemoryHistory(max_entries=100_000) as h:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    summary = summarize_snapshot(h.snapshot())   # from torchledger.analyzers.snapshot
    h.dump("step.pickle")          # opens at https://pytorch.org/memory_viz

On entry, recording starts through ``torch.cuda.memory._record_memory_history`` with every
alloc/free kept (``enabled="all"``), stacks at alloc and free (``context="all"``),
Python-only frames (``stacks="python"``, about 2 us per event; C++ unwinding costs more)
and a ring buffer of ``max_entries`` events (the newest are kept). On exit the snapshot is
taken first and recording is then switched off: switching off clears the allocator's
buffer, so the order matters.

The user's own recording is left alone. Whether the allocator is already recording is
read from ``torch._C._cuda_isHistoryEnabled()`` (the probe PyTorch's CUDA-graph trees
use). If it is, nothing is started or stopped: the snapshot holds what the user's settings
keep (their ``max_entries`` and stacks, history from before the block included). A
recording's settings cannot be read back, so changing them and restoring them is not
possible; we do not try. Where the probe is missing, whether a recording is active cannot
be detected; we then assume none is, say so in ``notes``, and stop recording on exit.

Known limitations:
  - the allocator's recording is process-wide and covers every device; ``device`` only
    chooses the device that :meth:`summary` reports.
  - without CUDA, entering does nothing (``available`` is False) and :meth:`snapshot`
    raises: a CPU build has no allocator data (``torch.cuda.max_memory_allocated()`` is 0
    there), and a zero would look like a measurement.
"""
from __future__ import annotations

import inspect
import os
import pickle

__all__ = ["CudaMemoryHistory", "UNAVAILABLE"]

#: The error every accessor raises on a machine without CUDA.
UNAVAILABLE = ("CUDA allocator data unavailable: no CUDA device "
               "(torch.cuda.max_memory_allocated() returns 0 on CPU builds)")


class CudaMemoryHistory:
    """Context manager: allocator history of the block, as a snapshot dict or a file."""

    def __init__(self, max_entries: int = 100_000, device=None, stacks: str = "python"):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1 (events kept), got {max_entries!r}")
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
        self.max_entries = max_entries
        """Most events kept; older ones are overwritten (several KB each with stacks)."""
        self.device = device
        """Device index (or ``torch.device``) that :meth:`summary` reports; None: all."""
        self.stacks = stacks
        self.available = False
        """True inside and after the block when CUDA was available on entry."""
        self.owns_recording = False
        """True while recording runs because we started it (False: the user's, or none)."""
        self.notes: list = []
        """What could not be done as asked, one sentence each."""
        self._entered = self._active = False
        self._snapshot = None

    # -- enter / exit ----------------------------------------------------------------------
    def __enter__(self) -> "CudaMemoryHistory":
        if self._active:
            raise RuntimeError("CudaMemoryHistory is already active; exit it before entering again")
        import torch
        self._entered, self._active, self._snapshot = True, True, None
        self.available = bool(torch.cuda.is_available())
        if not self.available:
            return self
        was = _is_recording(torch)
        if was:
            self.notes.append("the allocator was already recording: kept the user's recording "
                              "and its settings (max_entries, stacks) as they were")
            return self
        if was is None:
            self.notes.append("cannot tell whether the allocator was already recording "
                              "(torch._C._cuda_isHistoryEnabled is missing): assumed not")
        try:
            _start(torch, self.max_entries, self.stacks)
        except BaseException:
            self._active = False            # nothing started: the object can be entered again
            raise
        self.owns_recording = True
        return self

    def __exit__(self, exc_type, exc, tb):
        self._active = False
        if not self.available:
            return False
        import torch
        try:
            self._snapshot = torch.cuda.memory._snapshot()   # before stopping: stopping clears it
        except Exception as e:      # never hide the user's own exception behind ours
            self.notes.append(f"taking the snapshot failed: {type(e).__name__}: {e}")
        finally:
            if self.owns_recording:
                self.owns_recording = False
                torch.cuda.memory._record_memory_history(enabled=None)
        return False

    # -- results ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The snapshot dict: live inside the block, the one taken on exit after it."""
        if not self._entered:
            raise RuntimeError("enter the CudaMemoryHistory block first: `with CudaMemoryHistory() as h:`")
        if not self.available:
            raise RuntimeError(UNAVAILABLE)
        if self._active:
            import torch
            return torch.cuda.memory._snapshot()
        if self._snapshot is None:
            raise RuntimeError(f"no snapshot: {self.notes[-1] if self.notes else 'unknown error'}")
        return self._snapshot

    def dump(self, path) -> str:
        """Write the snapshot as ``torch.cuda.memory._dump_snapshot`` does (a pickle that
        pytorch.org/memory_viz and ``torchledger snapshot`` open); returns the path."""
        snap = self.snapshot()
        path = os.fspath(path)
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        return path


def _is_recording(torch):
    """True/False, or None when this build cannot tell."""
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if probe is None:
        return None
    try:
        return bool(probe())
    except Exception:
        return None


def _start(torch, max_entries: int, stacks: str) -> None:
    record = torch.cuda.memory._record_memory_history
    wanted = {"context": "all", "stacks": stacks, "max_entries": max_entries, "clear_history": True}
    try:
        params = inspect.signature(record).parameters
    except (TypeError, ValueError):
        params = {}
    named = {k for k, p in params.items() if p.kind is not p.VAR_KEYWORD}
    if {"context", "stacks", "max_entries"} <= named:
        kwargs = {k: v for k, v in wanted.items() if k in named}
    else:   # NB: a signature hidden behind **kwargs: pass what every torch >= 2.1 accepts
        kwargs = {k: wanted[k] for k in ("context", "stacks", "max_entries")}
    record("all", **kwargs)
