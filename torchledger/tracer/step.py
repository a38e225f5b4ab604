"""``StepTracer``: install every hook for one step, hand back a frozen ``StepRecord``.

While active it owns: one dispatch mode (``dispatch.LedgerMode``), global module
pre/post hooks (``modules.ModuleScope``), saved-tensor hooks (activations), global
optimizer step hooks (phase and state), and per-parameter post-accumulate-grad hooks
(gradients). All are entered on one ``ExitStack``: if installing any of them fails,
everything already installed is removed, and ``__exit__`` removes all of them even when
the step raised.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack

import torch

from ..record import StepRecord
from .build import build_record
from .compiled import observe_run
from .dispatch import BACKWARD, PHASES, LedgerMode, attention_hook
from .memory import ACT, BUFFER, GRAD, OPT, PARAM, TEMP, StorageTracker
from .modules import ModuleScope
from .outputs import output_cache

__all__ = ["StepTracer", "active_tracer"]

_ACTIVE: list = []   # at most one tracer at a time (process-wide)


def active_tracer():
    """The tracer now active, or None."""
    return _ACTIVE[0] if _ACTIVE else None


def check_optimizer(optimizer, who: str) -> None:
    """None, or something the tracer can walk: ``param_groups`` and a ``state`` mapping."""
    if optimizer is not None and not (hasattr(optimizer, "param_groups")
                                      and hasattr(getattr(optimizer, "state", None), "items")):
        raise TypeError(f"{who} expects optimizer= a torch.optim.Optimizer (param_groups and a "
                        f"state mapping), got {type(optimizer).__name__}")


class StepTracer:
    """Trace one training step of ``model`` (forward, backward, optimizer step).

    Example::

        with StepTracer(model, optimizer=opt, tokens=B * T) as t:
            model(x, y).backward(); opt.step(); opt.zero_grad()
        t.record.totals["flops"]["total"]

    Known limitations: one tracer at a time per process; ops run on threads other than the
    caller's and the autograd engine's are not seen; memory the step allocates through
    means other than aten ops (custom C++ extensions that allocate internally) is invisible.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, tokens=None, *,
                 clock=time.perf_counter, peak_flops=None, step_index: int = 0, seq_len=None,
                 carry=None, memory_history=True, tokens_source=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"trace() expects an nn.Module, got {type(model).__name__}")
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0):
            raise ValueError(f"tokens must be a positive int (tokens per step), got {tokens!r}")
        self._model = model          # strong until the step ends, then only a weakref
        self._model_ref = weakref.ref(model)
        check_optimizer(optimizer, "trace()")
        self._optimizers = [optimizer] if optimizer is not None else []
        if tokens_source is not None and not isinstance(tokens_source, str):
            raise ValueError(f"tokens_source must be a string (how tokens was obtained), "
                             f"got {tokens_source!r}")
        self.tokens = tokens
        self.tokens_source = tokens_source
        """How ``tokens`` was obtained, for ``totals.tokens_source``; default "given" when
        ``tokens`` is given (the audit names the input it counted)."""
        self.seq_len = seq_len
        self.clock = clock
        self.peak_flops = peak_flops
        self.step_index = step_index
        self.record: StepRecord | None = None
        self.carry_in = carry or {}     # storages kept from earlier steps (Ledger): key -> entry
        self.carry_out: dict = {}
        self.memory_history = memory_history
        """On CUDA: record the allocator's history (True, or the max events kept as an int)."""
        self.history = None
        self._stack: ExitStack | None = None

    # -- install / remove ------------------------------------------------------------------
    def __enter__(self) -> "StepTracer":
        if self._stack is not None or _ACTIVE:
            raise RuntimeError("a torchledger trace is already active; exit it before entering "
                               "another (use one Ledger for many steps)")
        model = self._model if self._model is not None else self._model_ref()
        if model is None:
            raise RuntimeError("the traced model no longer exists")
        self._model = model
        with ExitStack() as stack:
            model = self._model = observe_run(self, model, stack)   # torch.compile: eager, cache kept
            self.scope = ModuleScope(model)
            self.storages = StorageTracker()
            self._register_persistent(model)
            self.mode = LedgerMode(self.scope, self.storages, self._param_storages)
            self._saved: dict = {}
            self._warnings: list[str] = []
            self.cuda = _cuda_device(model)
            self._cuda_marks: list = []
            self.mode.on_phase = self._on_phase
            self.grad_bytes_at_backward = None
            self._grads_after_step: dict = {}
            self.optimizer_steps = 0
            self.scope.install(stack)
            self._output_caches: list = []
            stack.enter_context(model.register_forward_hook(self._model_output))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)
            stack.enter_context(register_optimizer_step_pre_hook(self._opt_pre))
            stack.enter_context(register_optimizer_step_post_hook(self._opt_post))
            for p in self._params:
                if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                    stack.enter_context(p.register_post_accumulate_grad_hook(self._grad_ready))
            attention_hook(self.mode, stack)
            if self.cuda is not None and self.memory_history:
                from .cuda_history import CudaMemoryHistory
                entries = self.memory_history if type(self.memory_history) is int else 100_000
                self.history = stack.enter_context(CudaMemoryHistory(max_entries=entries, device=self.cuda))
                self.mode.marks = []
            stack.callback(self.storages.close)
            _ACTIVE.append(self)
            stack.callback(_ACTIVE.clear)
            self._cuda_mark("start")
            self._t0 = self.clock()
            stack.enter_context(self.mode)     # last: nothing of ours runs under it
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb):
        stack, self._stack = self._stack, None
        try:
            stack.close()                          # mode, hooks, handles: all removed
        finally:
            self._cuda_mark("end", sync=True)
            seconds = self.clock() - self._t0
            model, self._model = self._model, None
            self.record = build_record(self, model, seconds, failed=exc_type is not None)
        return False

    # -- what exists before the step ---------------------------------------------------------
    def _register_persistent(self, model) -> None:
        st = self.storages
        self._params = list({id(p): p for p in model.parameters()}.values())
        self._param_storages = {}
        for p in self._params:
            s = p.untyped_storage()
            # params sharing one storage (cuDNN's flattened RNN weights) add up: a matmul that
            # reads the storage counts them all in N
            self._param_storages[s._cdata] = self._param_storages.get(s._cdata, 0) + p.numel()
            st.add(s, PARAM, at=0)
            if p.grad is not None:
                st.add(p.grad.untyped_storage(), GRAD, at=0)
        for b in model.buffers():
            st.add(b.untyped_storage(), BUFFER, at=0)
        for opt in self._optimizers:
            for t in _state_tensors(opt):
                st.add(t.untyped_storage(), OPT, at=0)
        self._carried = {}              # lifetime index -> origin, for storages from earlier steps
        for entry in self.carry_in.values():
            s = entry["ref"]()
            if s is not None:
                self._carried[st.add(s, entry["category"], at=0)] = entry["origin"]

    # -- hooks (never raise into the user's step) ------------------------------------------
    def _pack(self, t):
        try:
            s = t.untyped_storage()
            if s._cdata in self._param_storages:
                return t
            # keyed by lifetime, not address: a storage freed by micro-batch 1's backward and
            # one that micro-batch 2 makes at the same address are two activations
            forward = _current_node() is None
            k = self.storages.promote(s, ACT, only_from=TEMP) if forward else self.storages.add(s, TEMP)
            if k not in self._saved and self.storages.cat[k] != BUFFER:  # BatchNorm's running stats
                self._saved[k] = (s.nbytes(), self.scope.top, "forward" if forward else "recompute")
        except Exception as e:
            self._warn(f"saved-tensor hook: {type(e).__name__}: {e}")
        return t

    def _model_output(self, model, args, output):
        """A key/value cache returned by a training forward (see ``outputs``)."""
        try:
            if not model.training or not torch.is_grad_enabled() or _current_node() is not None:
                return
            found = output_cache(output)
            if found is None:
                return
            name, cache_type, tensors = found
            lifetimes, nbytes = set(), {}
            for t in tensors:
                s = t.untyped_storage()
                nbytes[s._cdata] = s.nbytes()
                k = self.storages.live.get(s._cdata)
                if k is not None:
                    lifetimes.add(k)
            self._output_caches.append({"field": name, "cache_type": cache_type, "tensors": len(tensors),
                                        "bytes": sum(nbytes.values()), "lifetimes": sorted(lifetimes)})
        except Exception as e:
            self._warn(f"model output hook: {type(e).__name__}: {e}")

    def _grad_ready(self, p):
        try:
            if p.grad is not None:
                self.storages.promote(p.grad.untyped_storage(), GRAD)
        except Exception as e:
            self._warn(f"grad hook: {type(e).__name__}: {e}")

    def _opt_pre(self, opt, args, kwargs):
        self._cuda_mark("optimizer-start")
        self.mode.in_optimizer += 1
        if all(o is not opt for o in self._optimizers):
            self._optimizers.append(opt)

    def _on_phase(self, phase: int) -> None:
        if phase == BACKWARD and self.grad_bytes_at_backward is None:
            self.grad_bytes_at_backward = sum(p.grad.nbytes for p in self._params if p.grad is not None)
        if self.cuda is not None:
            self._cuda_mark(PHASES[phase])

    def _opt_post(self, opt, args, kwargs):
        self.mode.in_optimizer = max(0, self.mode.in_optimizer - 1)
        self.optimizer_steps += 1
        self._grads_after_step = {p.grad.untyped_storage()._cdata: p.grad.nbytes
                                  for p in self._params if p.grad is not None}
        self.mode.zeroed.clear()
        self.mode.grad_watch = True
        try:
            for t in _state_tensors(opt):
                self.storages.promote(t.untyped_storage(), OPT)
        except Exception as e:
            self._warn(f"optimizer hook: {type(e).__name__}: {e}")
        self._cuda_mark("optimizer-end")

    def _cuda_mark(self, label: str, sync: bool = False) -> None:
        if self.cuda is None:
            return
        try:
            if sync:
                torch.cuda.synchronize(self.cuda)   # NB: a CPU-GPU sync point, at step edges only
            self._cuda_marks.append({
                "at": label, "op_index": self.mode.n_ops,
                "allocated_bytes": torch.cuda.memory_allocated(self.cuda),
                "reserved_bytes": torch.cuda.memory_reserved(self.cuda),
                "max_allocated_bytes": torch.cuda.max_memory_allocated(self.cuda)})
        except Exception as e:
            self._warn(f"CUDA memory stats unavailable: {e}")

    def _warn(self, msg: str) -> None:
        if len(self._warnings) < 50:
            self._warnings.append(msg)


_current_node = torch._C._current_autograd_node


def _unpack(t):
    return t


def _state_tensors(opt):
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def _cuda_device(model):
    for p in model.parameters():
        if p.device.type == "cuda" and not _is_fake(p) and torch.cuda.is_available():
            return p.device
        return None
    return None


def _is_fake(t) -> bool:
    return type(t).__name__ == "FakeTensor"
