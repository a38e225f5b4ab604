"""``StepTracer``: install every hook for one step, hand back a frozen ``StepRecord``.

While active it owns: one dispatch mode (``dispatch.LedgerMode``), global module
pre/post hooks (``modules.ModuleScope``), saved-tensor hooks (activations), global
optimizer step hooks (phase and state), and per-parameter post-accumulate-grad hooks
(gradients), and the SDPA wrapper. Each goes in through one ``lifecycle.Installed`` with an
idempotent undo: if installing any of them fails (or Ctrl-C arrives), everything already
installed is removed; ``__exit__`` removes all of them even when the step raised or is
interrupted, and a KeyboardInterrupt is delivered once nothing is left installed. The global
hooks record only the tracing thread's work and the autograd engine's for its backward.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack
from _thread import get_ident

import torch

from ..record import StepRecord
from .build import build_record
from .collectives import pipeline_p2p_hook
from .compiled import observe_run
from .dispatch import LedgerMode, attention_hook, is_wrapper_subclass
from .phases import BACKWARD, PHASES
from .fake import foreign_fake_params
from .dist_memory import accumulated_grads, install_distributed
from .lifecycle import ACTIVE, TRIES, Installed, in_tls
from .memory import ACT, BUFFER, GRAD, OPT, PARAM, PLAIN, TEMP, StorageTracker, data_tensors, state_tensors, tensor_bytes
from .modules import ModuleScope
from .outputs import output_cache
from .gpu_kernels import gpu_kernel_hook
from .selective import selective_checkpoint_hook
from ..record.tokens import infer_tokens
from .cuda_history import CudaMemoryHistory

__all__ = ["StepTracer", "active_tracer"]

_STRIDED = torch.strided


def active_tracer():
    """The tracer now active, or None."""
    return ACTIVE[0] if ACTIVE else None


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

    #: Observe a fake step from inside its FakeTensorMode where that sees the same ops
    #: (``_fake_mode_to_attach``); False: always as a dispatch mode on the stack (tests compare both)
    attach_fake = True

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
        self._optimizers = [_inner_optimizer(optimizer)] if optimizer is not None else []
        if tokens_source is not None and not isinstance(tokens_source, str):
            raise ValueError(f"tokens_source must be a string (how tokens was obtained), "
                             f"got {tokens_source!r}")
        self.tokens = tokens
        self.tokens_source = tokens_source
        """How ``tokens`` was obtained, for ``totals.tokens_source``; default "given" when
        ``tokens`` is given (the audit names the input it counted)."""
        self.seq_len = seq_len
        self.seq_len_read = None
        """Without ``seq_len``: ``(T, where)`` read off the model's first call as the audit reads
        its inputs (``spec.infer_tokens``: the last dim of 2-D integer token ids), else None."""
        self.clock = clock
        self.peak_flops = peak_flops
        self.step_index = step_index
        self.record: StepRecord | None = None
        self.carry_in = carry or {}     # storages kept from earlier steps (Ledger): key -> entry
        self.carry_out: dict = {}
        self.memory_history = memory_history
        """On CUDA: record the allocator's history (True, or the max events kept as an int)."""
        self.history = None
        self._life: Installed | None = None

    # -- install / remove ------------------------------------------------------------------
    def __enter__(self) -> "StepTracer":
        if self._life is not None:
            raise RuntimeError("StepTracer is already active; exit it before entering again")
        model = self._model if self._model is not None else self._model_ref()
        if model is None:
            raise RuntimeError("the traced model no longer exists")
        life = self._life = Installed()
        try:
            life.watch_sigint(_CRITICAL)     # Ctrl-C in here waits until all is in place
            life.lock(self)                  # one tracer at a time, across threads
            self._model, self._thread = model, get_ident()
            self._install(model, life)
            life.deliver()                   # a Ctrl-C noted meanwhile raises here
            return self
        except BaseException:
            for _ in range(TRIES):           # re-run until done: every undo is idempotent
                try:
                    life.close()
                    break
                except KeyboardInterrupt:
                    pass
            self._life = None
            self._release()
            raise

    def _install(self, model, life) -> None:
        """Everything for the step, each piece registered on ``life`` as it goes in (see
        ``lifecycle``); the dispatch mode last, so nothing of ours runs under it."""
        undo = life.undo.append          # C: nothing can interrupt between register and undo
        compiled = ExitStack()
        undo(compiled.close)
        self._warnings: list[str] = []   # before the probe below, which may warn
        model = self._model = observe_run(self, model, compiled, undo)   # torch.compile: eager, cache kept
        self._reset(model)
        self.scope.install(undo)
        undo(model.register_forward_hook(self._model_output).remove)
        self.seq_len_read = None
        if self.seq_len is None:
            undo(model.register_forward_pre_hook(self._model_input, with_kwargs=True).remove)
        life.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        undo(register_optimizer_step_pre_hook(self._opt_pre).remove)
        undo(register_optimizer_step_post_hook(self._opt_post).remove)
        for p in self._params:
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                undo(p.register_post_accumulate_grad_hook(self._grad_ready).remove)
        attention_hook(self.mode, life, self._ours)
        self.gpu_kernels = {}
        if self._params and _is_fake(getattr(self._params[0], "_local_tensor", self._params[0])):
            # a fake step (a DTensor's local shard, under a simulated world) describes a GPU run
            scope = self.scope
            gpu_kernel_hook(life, self._ours, self.gpu_kernels,
                            where=lambda: (scope.module(scope.top), scope.module(0)), masks=self.mode.masks)
        unseen = selective_checkpoint_hook(self.note_saved, life, self._ours)   # SAC's kept outputs
        if unseen:
            self._warn(unseen)
        pipeline_p2p_hook(self.mode.p2p_tags, life, self._ours, self.scope.index_of, self._warn)  # PP stages
        install_distributed(self, life)      # a distributed step only: FSDP's gathered parameters
        if self.cuda is not None and self.memory_history:
            entries = self.memory_history if type(self.memory_history) is int else 100_000
            self.history = CudaMemoryHistory(max_entries=entries, device=self.cuda)
            life.undo.append(lambda h=self.history: h.__exit__(None, None, None))
            self.history.__enter__()
            self.mode.marks = []
        life.undo.append(self.storages.close)
        self._cuda_mark("start")
        self._t0 = self.clock()
        fake = self._fake_mode_to_attach() if self.attach_fake else None
        if fake is not None:
            self.mode.attach(fake, life, self._thread)
        else:
            life.dispatch_mode(self.mode)

    def _fake_mode_to_attach(self):
        """The FakeTensorMode this step runs under, when the tracer can observe it from inside
        (``LedgerMode.attach``: half the Python crossings per op) and see the same ops a
        dispatch mode pushed above it would: it is the only dispatch mode, a plain
        FakeTensorMode's dispatch, no DTensor parameters and no process group (a distributed
        step's collectives and DTensor ops are seen from above), no CUDA parameters (their
        backward runs on the engine's device threads). Else None."""
        if self.cuda is not None or torch._C._len_torch_dispatch_stack() != 1:
            return None
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if fake is None or "dispatch" in vars(fake):
            return None
        from torch._subclasses.fake_tensor import FakeTensorMode
        if type(fake).__torch_dispatch__ is not FakeTensorMode.__torch_dispatch__:
            return None
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return None
        if any(is_wrapper_subclass(type(p)) for p in self._params):
            return None
        return fake

    def _reset(self, model) -> None:
        """The per-step recorder, fresh."""
        self.scope = ModuleScope(model)
        self.scope.ours = self._ours
        self.storages = StorageTracker()
        self._register_persistent(model)
        self.mode = LedgerMode(self.scope, self.storages, self._param_storages)
        self._saved: dict = {}
        self.cuda = _cuda_device(self._params)
        self._cuda_marks: list = []
        self.mode.on_phase = self._on_phase
        self.grad_bytes_at_backward = None
        self._grads_after_step: dict = {}
        self.optimizer_steps = 0
        self._output_caches: list = []
        self._pack_hook = self._pack     # one bound method: lifecycle finds it on the hook stack
        self._unpack_hook = self._unpack

    def __exit__(self, exc_type, exc, tb):
        life, interrupt, errors = self._life, None, []
        for _ in range(TRIES):               # re-run until done: every undo is idempotent
            try:
                errors = life.close()        # mode, hooks, handles, patch, lock: all removed
                break
            except KeyboardInterrupt as e:   # delivered below, once everything is removed
                interrupt = interrupt or e
        self._life = None
        try:
            self._warnings.extend(errors)
            self._cuda_mark("end", sync=True)
            try:
                seconds = self.clock() - self._t0
            except Exception as e:  # noqa: BLE001 (a clock that raises must not lose the record)
                seconds = None
                self._warnings.append(f"step time left out: the clock raised {type(e).__name__}: {e}")
            model, self._model = self._model, None
            self.record = build_record(self, model, seconds, failed=exc_type is not None)
        finally:
            self._release()
        if interrupt is not None:
            raise interrupt
        self._finished()
        return False

    def _finished(self) -> None:
        """Called once the record is built (``trace()`` computes its findings here)."""

    def _ours(self) -> bool:
        """This thread works for the traced step: the tracing thread, or an autograd engine
        thread running its backward. Other threads' forwards and optimizer steps are not
        recorded (the global hooks see them too)."""
        return get_ident() == self._thread or in_tls(self.mode)

    def _release(self) -> None:
        """After the step: keep the record and weak references only (no parameter, optimizer,
        state or hook of the step stays reachable from this object)."""
        self._params, self._optimizers, self._param_storages = [], [], {}
        self.scope = self.storages = self.mode = self.history = None
        self._saved, self._grads_after_step, self._carried, self.carry_in = {}, {}, {}, {}
        self._carried_tensor = {}
        self._output_caches, self._cuda_marks = [], []
        # the saved-tensor hook, a bound method of this tracer kept on it: a reference cycle that
        # only a full collection would free, and with it the record once a Ledger drops it
        self._pack_hook = self._unpack_hook = None

    # -- what exists before the step ---------------------------------------------------------
    def _register_persistent(self, model) -> None:
        st = self.storages
        # model.parameters(), each once (the scope found them; it keeps no parameter)
        self._params, self.scope.params = self.scope.params, []
        foreign = foreign_fake_params(self._params)
        if foreign:
            self._warn(f"{foreign} of {len(self._params)} parameters are fake tensors of another "
                       f"FakeTensorMode (copy.deepcopy of a fake module, e.g. nn.TransformerEncoder's "
                       f"layers, copies the mode): the step converts them at every op, so N misses "
                       f"their matmuls and memory counts the converted copies; build the model under one "
                       f"mode whose deepcopy is itself (`mode.__deepcopy__ = lambda memo: mode`), as "
                       f"torchledger audit does")
        self._param_storages = {}
        for p in self._params:
            for s in self._storages(p, "parameter"):
                # params sharing one storage (cuDNN's flattened RNN weights) add up: a matmul that
                # reads the storage counts them all in N
                self._param_storages[s._cdata] = self._param_storages.get(s._cdata, 0) + p.numel()
                st.add(s, PARAM, at=0)
            if p.grad is not None:
                self._track(p.grad, GRAD, "gradient", at=0)
        for g in accumulated_grads(model):         # FSDP2's, between micro-batches
            self._track(g, GRAD, "gradient", at=0)
        for b in model.buffers():
            self._track(b, BUFFER, "buffer", at=0)
        for opt in self._optimizers:
            for _, t in state_tensors(opt):
                self._track(t, OPT, "optimizer state", at=0)
        self._carried = {}              # lifetime index -> origin, for storages from earlier steps
        self._carried_tensor = {}       # ... -> weakref of the tensor the op that made it returned
        for entry in self.carry_in.values():
            s = entry["ref"]()
            if s is not None:
                k = st.add(s, entry["category"], at=0)
                self._carried[k] = entry["origin"]
                self._carried_tensor[k] = entry.get("tensor")

    def _storages(self, t, what: str) -> list:
        """``memory.storages(t)``, or [] with a warning for a tensor kind that has none."""
        try:
            if type(t) in PLAIN and t.layout is _STRIDED:      # the common case
                return [t.untyped_storage()]
            return [x.untyped_storage() for x in data_tensors(t)]
        except Exception as e:
            self._warn(f"{what} of type {type(t).__name__} (layout {t.layout}) not counted: "
                       f"{type(e).__name__}: {e}")
            return []

    def _data(self, t, what: str) -> list:
        """``memory.data_tensors(t)`` (those with a storage), or [] with a warning."""
        try:
            data = data_tensors(t)
            for x in data:
                x.untyped_storage()
            return data
        except Exception as e:
            self._warn(f"{what} of type {type(t).__name__} (layout {t.layout}) not counted: "
                       f"{type(e).__name__}: {e}")
            return []

    def _track(self, t, category: int, what: str, at=None, promote: bool = False) -> None:
        for s in self._storages(t, what):
            if promote:
                self.storages.promote(s, category)
            else:
                self.storages.add(s, category, at=at)

    # -- hooks (never raise into the user's step) ------------------------------------------
    def _pack(self, t):
        self.note_saved(t)
        return self._detached(t)

    def note_saved(self, t) -> None:
        """Count ``t`` as kept for backward: an activation when saved in forward (keyed by its
        storage's lifetime: once however many ops keep it), else recomputation's. Autograd's
        saved tensors come through ``_pack``; the outputs a selective-checkpoint policy keeps
        through ``selective.selective_checkpoint_hook``."""
        try:
            forward = _current_node() is None
            for s in self._storages(t, "saved tensor"):
                if s._cdata in self._param_storages or s._cdata in self.mode.gathered_params:
                    continue                # a weight (FSDP2's gathered ones too), not an activation
                # keyed by lifetime, not address: a storage freed by micro-batch 1's backward and
                # one that micro-batch 2 makes at the same address are two activations
                k = self.storages.promote(s, ACT, only_from=TEMP) if forward else self.storages.add(s, TEMP)
                if k not in self._saved and self.storages.cat[k] != BUFFER:  # BatchNorm's running stats
                    self._saved[k] = (s.nbytes(), self.scope.top, "forward" if forward else "recompute")
        except Exception as e:
            self._warn(f"saved-tensor hook: {type(e).__name__}: {e}")

    def _detached(self, t):
        """What autograd keeps for a saved tensor: ``t`` without its autograd history when
        ``t`` is the output of the op being recorded.

        Returning ``t`` itself makes a cycle for every op that saves its own output (relu,
        exp, softmax...): output -> grad_fn -> saved output. The cycle runs through C++, so
        Python's gc never frees it, and the graph of a forward that is never backpropagated
        (an eval forward without no_grad) would live for the rest of the process (torch's
        ``saved_tensors_hooks`` docs: return ``x.detach()``). Autograd gives the unpacked
        tensor its history back; the detach shares storage and version counter. It is recorded,
        under grad mode as the op that saved it ran: without hooks autograd keeps such an output
        as ``tensor_data()``, the same detach (a dispatch mode sees it), so the step's views
        count the same with the hooks on and off. Any other saved tensor closes no cycle and is kept as it
        is: a weight or an input has no ``grad_fn``, and a saved input's ``grad_fn`` is an
        older node, which never reaches the node saving it. The node being made is the
        newest on this thread (its sequence number is one below the counter), so only a
        tensor whose ``grad_fn`` is that node is detached (on fake tensors each detach is a
        FakeTensorMode op)."""
        try:
            fn = t.grad_fn
            if fn is None or fn._sequence_nr() < _get_sequence_nr() - 1:
                return t
        except Exception as e:
            self._warn(f"saved-tensor hook: {type(e).__name__}: {e}")
        try:
            with _enable_grad():
                return t.detach()
        except Exception as e:
            self._warn(f"saved-tensor hook: {type(e).__name__}: {e}")
            return t

    def _unpack(self, t):
        """A saved tensor back to autograd. One autograd keeps as it is without hooks (an input,
        a leaf) it re-wraps with a detach because a hook gave it (``SavedVariable::unpack``):
        the dispatch mode leaves that one out (``LedgerMode._unpack_detach``). A saved output
        (detached by ``_pack``) is re-wrapped with or without hooks: recorded."""
        try:
            if t.requires_grad and self.mode is not None:
                self.mode.unpacked = t
        except Exception as e:
            self._warn(f"saved-tensor unpack hook: {type(e).__name__}: {e}")
        return t

    def _model_input(self, model, args, kwargs):
        """T off the model's first call, by the audit's rule (one inference of T for both)."""
        if self.seq_len_read is not None or not self._ours():
            return
        try:
            count = infer_tokens(kwargs if not args else (*args, kwargs) if kwargs else args, model)
            where = count.source.replace("numel of ", "last dim of ", 1)
            self.seq_len_read = (count.seq_len, where) if count.seq_len else (None, None)
        except Exception as e:
            self._warn(f"model input hook: {type(e).__name__}: {e}")

    def _model_output(self, model, args, output):
        """A key/value cache returned by a training forward (see ``outputs``)."""
        try:
            if (not model.training or not torch.is_grad_enabled() or _current_node() is not None
                    or not self._ours()):
                return
            found = output_cache(output)
            if found is None:
                return
            name, cache_type, tensors = found
            lifetimes, nbytes = set(), {}
            self.storages.drain()
            for t in tensors:
                for s in self._storages(t, "returned cache tensor"):
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
            if p.grad is not None and self._ours():
                self._track(p.grad, GRAD, "gradient", promote=True)
        except Exception as e:
            self._warn(f"grad hook: {type(e).__name__}: {e}")

    def _opt_pre(self, opt, args, kwargs):
        if not self._ours():                 # another thread's optimizer
            return
        try:
            self._cuda_mark("optimizer-start")
            self.mode.in_optimizer += 1
            if all(o is not opt for o in self._optimizers):
                self._optimizers.append(opt)
            return _closure_outside(self.mode, args, kwargs)
        except Exception as e:
            self._warn(f"optimizer hook: {type(e).__name__}: {e}")

    def _on_phase(self, phase: int) -> None:
        try:
            if phase == BACKWARD and self.grad_bytes_at_backward is None:
                self.grad_bytes_at_backward = sum(tensor_bytes(p.grad) for p in self._params
                                                  if p.grad is not None)
        except Exception as e:
            self._warn(f"gradient bytes at backward: {type(e).__name__}: {e}")
        if self.cuda is not None:
            self._cuda_mark(PHASES[phase])

    def _opt_post(self, opt, args, kwargs):
        if not self._ours():
            return
        try:
            self.mode.in_optimizer = max(0, self.mode.in_optimizer - 1)
            self.optimizer_steps += 1
            self._grads_after_step = {x.untyped_storage()._cdata: x.nbytes for p in self._params
                                      if p.grad is not None for x in self._data(p.grad, "gradient")}
            self.mode.zeroed.clear()
            self.mode.grad_watch = True
            for _, t in state_tensors(opt):
                self._track(t, OPT, "optimizer state", promote=True)
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
_enable_grad = torch.enable_grad
_get_sequence_nr = torch._C._autograd._get_sequence_nr


def _inner_optimizer(optimizer):
    """The optimizer a wrapper delegates to (accelerate's ``AcceleratedOptimizer``, which the HF
    Trainer holds: a ``torch.optim.Optimizer`` subclass sharing its ``.optimizer``'s state).
    The step hooks see the inner one step, so tracing the wrapper too would count the state
    twice."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _closure_outside(mode, args, kwargs):
    """``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs the step's
    forward and backward inside the optimizer step: the closure is wrapped so that its work is
    recorded in its own phases, not as optimizer work. None (arguments unchanged) without one.
    ``args`` holds the optimizer first (torch's pre-hook convention)."""
    def outside(closure):
        def run_closure():
            depth, mode.in_optimizer = mode.in_optimizer, 0
            try:
                return closure()
            finally:
                mode.in_optimizer = depth
        return run_closure
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": outside(kwargs["closure"])}
    if len(args) > 1 and callable(args[1]):
        return (args[0], outside(args[1]), *args[2:]), kwargs
    return None


#: Code during which a SIGINT is deferred (``lifecycle.Installed.watch_sigint``).
_CRITICAL = {StepTracer.__enter__.__code__, StepTracer.__exit__.__code__}


def _cuda_device(params: list):
    p = params[0] if params else None
    if p is not None and p.device.type == "cuda" and not _is_fake(p) and torch.cuda.is_available():
        return p.device
    return None


def _is_fake(t) -> bool:
    return type(t).__name__ == "FakeTensor"
