"""The hot path: one TorchDispatchMode that sees every aten op of the step.

Per op it finds the phase (forward, backward, recompute, optimizer), the module, the FLOPs
(``flops.op_flops``), the bytes read and written, new storages (for live memory) and
copies. Everything is aggregated on the fly into dicts keyed by (phase, module, op); only
copies keep per-event detail (with the user's source line, looked up for copies alone).
"""
from __future__ import annotations

import os
import sys
import time
from _thread import get_ident

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bisect import bisect_right

from torch._C._autograd import _get_sequence_nr

from .collectives import COLLECTIVES, FSDP_COPY_OUT, IGNORED, InnerCollectives, describe, lookup, p2p_tag
from .flops import FlopCount, grads_needed, handler_of, is_free, is_pointwise
from .memory import PLAIN, TEMP, storages, tensor_bytes
from .modules import NO_MODULE
from .opshapes import ShapeLog, close_chain, note_mask, note_op   # the step-time model's per-op facts
from .attn_masks import MaskFacts
from .phases import BACKWARD, FORWARD, OPTIMIZER, OTHER, PHASES, RECOMPUTE  # noqa: F401  (re-exported)

__all__ = ["LedgerMode", "PHASES"]


_Tensor = torch.Tensor
_current_node = torch._C._current_autograd_node
_grad_enabled = torch.is_grad_enabled
_top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _needs_grad(args) -> bool:
    """Some tensor argument (or one in a list argument) requires grad."""
    return any(isinstance(a, _Tensor) and a.requires_grad for a in _operands(args))


def _recomputing(node) -> bool:
    """An op run during backward with grad enabled is either activation-checkpoint
    recomputation or a ``create_graph=True`` backward; it is recomputation when the node
    running is reentrant checkpoint's, or non-reentrant checkpoint's recomputation hooks are
    the innermost saved-tensor hooks. (Recomputation that calls modules is already known from
    the module hooks that fire during backward: see ``modules.ModuleScope``.)"""
    if node.name() == "CheckpointFunctionBackward":
        return True
    hooks = _top_saved_hooks(False)
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook")
_aten = torch.ops.aten
_DETACH = _aten.detach.default
_COPY_OPS = {_aten.clone.default, _aten._to_copy.default, _aten.copy_.default}
_GATHER_OPS = {_aten.index.Tensor, _aten.index_select.default}
_PERMUTE_OPS = {_aten.transpose.int, _aten.permute.default, _aten.t.default}
_PASSTHROUGH = {id(op) for op in (  # no arithmetic, no memory, no phase: not recorded at all
    torch.ops.prim.device.default, torch.ops.prim.layout.default,
    # record_function markers (optimizer.zero_grad and step wrap themselves in one)
    *(getattr(getattr(torch.ops.profiler, name, None), overload, None)
      for name, overload in (("_record_function_enter", "default"),
                             ("_record_function_enter_new", "default"),
                             ("_record_function_exit", "default"),
                             ("_record_function_exit", "_RecordFunction"))))
    if op is not None}
_NO_KWARGS: dict = {}
_ZERO_ROW = (0, 0, 0, 0, 0)
_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
_SAFE_SOFTMAX = getattr(getattr(_aten, "_safe_softmax", None), "default", None)  # SDPA math only
_ZERO_OPS = {_aten.zero_.default, _aten.fill_.Scalar, _aten._foreach_zero_.default}
_MUL_OPS = {_aten.mul_.Tensor, _aten.mul_.Scalar, _aten._foreach_mul_.Scalar}  # zero when times 0
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
try:                                  # a deprecation wrapper's frame is not the user's line
    import typing_extensions as _te
    _COLLECTIVE_SKIP = _SKIP_DIRS + (_te.__file__,)
except ImportError:
    _COLLECTIVE_SKIP = _SKIP_DIRS


#: id(func) -> what an op's schema says (``LedgerMode._static``), worked out once per process;
#: the ops are pinned in _PINNED so an id is never reused by another object
_FINFO: dict = {}
_PINNED: list = []


def _is_alias_op(func) -> bool:
    """True when some output of ``func`` aliases an input (views and in-place ops)."""
    return any(r.alias_info is not None for r in func._schema.returns)


#: ``audit``'s runner: the frames past it are its callers (click, runpy), never the user's line
_RUNNER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "audit", "engine.py")


#: How far up the stack a collective issued in backward outside every module looks for the
#: FSDP2 unit reducing (its ``post_backward`` frame is within a few calls of the collective).
_UNIT_FRAMES = 24


def user_frame(skip=_SKIP_DIRS) -> str | None:
    """``path:line`` of the first frame outside torch and torchledger (the user's line), or
    None when the op was reached from ``audit``'s own default step (no user line above it)."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn == _RUNNER:
            return None
        if not fn.startswith(skip) and not fn.startswith("<frozen"):
            rel = _RELPATH.get(fn)
            if rel is None:
                rel = _RELPATH[fn] = os.path.relpath(fn) if not fn.startswith("<") else fn
            return f"{rel}:{f.f_lineno}"
        f = f.f_back
    return None


_RELPATH: dict = {}     # file -> its path relative to the working directory (see LedgerMode)
_RELPATH_CWD: list = [None]


class LedgerMode(TorchDispatchMode):
    """Aggregates every op into the recorder (see ``step.StepTracer``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NB: TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo (five Python
        # calls per op) so that dynamo never compiles it; a traced step runs with the compile
        # stance forced eager (compiled.py), so dynamo never runs there. Where torch has no
        # stance to force, keep the wrapper.
        return not hasattr(getattr(torch, "compiler", None), "set_stance")

    def __init__(self, scope, storages, params_by_storage):
        super().__init__()
        fake = sys.modules.get("torch._subclasses.fake_tensor")    # none made before its import
        self._fake = getattr(fake, "FakeTensor", None)
        try:
            cwd = os.getcwd()
        except OSError:                 # a working directory that was removed: no cache
            cwd = None
        if cwd is None or _RELPATH_CWD[0] != cwd:   # user_frame's cache holds paths relative to the cwd
            _RELPATH.clear()
            _RELPATH_CWD[0] = cwd
        self.scope = scope
        self.storages = storages
        self.param_storages = params_by_storage      # storage cdata -> param numel
        self.in_optimizer = 0
        self.n_ops = 0
        self.op_module: list[int] = []
        self.op_phase: list[int] = []
        self.op_func: list[int] = []     # id(func) per op, and its matmul-class FLOPs (segments.py)
        self.op_flops: list[int] = []
        # (phase, module, id(func)) -> offset r of its row in ``agg_vals``: count at r, flops at
        # r + 1, causal flops r + 2, bytes read r + 3, bytes written r + 4 (one flat list of
        # ints, not a list per row: nothing per row for the gc to track and walk)
        self.agg: dict = {}
        self.agg_vals: list[int] = []
        self.elementwise = [0] * len(PHASES)
        self.uncounted: dict = {}    # (id(func), phase, module) -> count
        self.copies: dict = {}       # (func, module, phase, location, reason) -> [count, bytes, detail]
        self.matmul_params: set = set()
        self.param_matmul_flops = 0  # forward matmul FLOPs with a parameter operand: 2 x sum(P x rows)
        self.param_grad_flops = 0    # their gradient matmuls: forward x operands that need grad
        self.kinds: dict = {}        # id(func) -> FLOP kind (None: no formula)
        self.funcs: dict = {}        # id(func) -> func (kept alive, so ids are not reused)
        self.attention_kernels: dict = {}
        self.phase_changes: list = []   # (op index, phase) where the phase changed
        self._last_phase = -1
        self.on_phase = None         # callback(phase) at phase changes (CUDA memory marks)
        self._finfo = {}             # id(func) -> what its schema says (``_static``)
        self.shape_log = ShapeLog()  # matmul/attention shapes and elementwise chains (opshapes.py)
        self.grad_watch = False      # after an optimizer step: note grads being zeroed
        self.zeroed: set = set()
        self.scalar_sites: dict = {}  # op index -> user line, for 0-dim forward outputs
        self.errors: list[str] = []
        self._copied: dict = {}      # lifetime of a contiguous() copy -> (its copy key, source dim order)
        self._casts: dict = {}       # lifetime of a dtype cast's output -> (copy key, source dtype)
        self.sdpa_depth = 0          # > 0 inside F.scaled_dot_product_attention (see attention_hook)
        self.sdpa_causal = False
        self.masks = MaskFacts()     # explicit attention masks: causal or not (attn_masks.py)
        self.attn_ranges: list = []  # (first seq nr, end seq nr, causal) of SDPA calls
        self._attn_starts: list = []
        self._math_attention: dict = {}
        self._last_matmul = None     # (agg key, FLOPs, node seq) of the last forward matmul
        self._scores_start = None    # an unwrapped SDPA's scores were seen: its x V comes next
        self._view_checked: dict = {}    # id(func) -> alias confirmed by storage identity
        self.views = [0] * len(PHASES)   # view/alias ops per phase (no bytes moved)
        self.marks = None            # list of {time_us, module, phase} on CUDA (allocator join)
        self._last_mark = None
        self.derived_params: dict = {}   # lifetime of a cast/copy of a parameter -> the parameter's storage
        self.gathered_params: dict = {}  # FSDP2: storage of a parameter's unsharded buffer -> numel
        self.tensor_parallel = 1         # the largest global/local split of a weight at a matmul
        self.quiet = 0               # > 0: the tracer's own ops, not recorded
        self.unpacked = None         # a saved tensor the unpack hook just gave autograd (``_unpack_detach``)
        self.collectives: dict = {}  # (op, group size, group span, phase, module, location) -> [count, sent, received, algo, bus]
        self.on_collective = None    # callback(op, func, args, kwargs, out) after a collective (dist_memory)
        self.collective_ids = lookup()   # ids of c10d / functional-collective ops (collectives.py)
        self.p2p_ids = frozenset(id(f) for f, row in COLLECTIVES.items() if row[0] in ("send", "recv"))
        self.p2p_tags: dict = {}     # id(tensor) -> (weakref, phase name, module) of a pipeline stage's P2POp
        self._inside = False         # attached: an op is being observed (nested ones are the mode's own)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None, run=None):
        """One op. As a mode on the stack, ``run`` is None and the op runs as ``func(*args,
        **kwargs)`` (the modes below it next); attached to a FakeTensorMode (``attach``),
        ``run`` is that mode's own ``dispatch``."""
        kwargs = kwargs or _NO_KWARGS       # shared, never written: no dict made per op
        if (id(func) in _PASSTHROUGH or self.quiet   # metadata queries (fake tensors ask prim.device often)
                or (self.unpacked is not None and self._unpack_detach(func, args))):
            if func is _PRIM_DEVICE and self._fake is not None and len(args) == 1 and type(args[0]) is self._fake:
                # NB: FakeTensorMode's own answer (fake_tensor._device_handler), given here: a 7B
                # fake step asks ~14,000 times, and each trip through FakeTensorMode.dispatch costs
                # more than the rest of this method
                a = args[0]
                return _META if a.fake_mode.in_kernel_invocation else a.fake_device
            return func(*args, **kwargs) if run is None else run(func, types, args, kwargs)
        try:                    # where we are is known before the op runs (CUDA marks need it)
            node = _current_node()
            scope = self.scope
            if node is not None:
                if scope.recompute_depth:
                    phase, mod = RECOMPUTE, scope.top
                elif _grad_enabled() and _recomputing(node):   # checkpointed code without modules
                    phase, mod = RECOMPUTE, scope.module_of_node(node)
                    scope.recomputing_in(mod)
                else:
                    phase, mod = BACKWARD, scope.module_of_node(node)
            elif self.p2p_tags and id(func) in self.p2p_ids and (tag := p2p_tag(self.p2p_tags, args)):
                phase, mod = PHASES.index(tag[0]), tag[1]   # a pipeline stage's send/receive
            elif self.in_optimizer:
                phase, mod = OPTIMIZER, scope.top
            elif scope.stack or (_grad_enabled() and _needs_grad(args)):
                phase, mod = FORWARD, scope.top      # in a module, or building the loss's graph
            else:
                phase, mod = OTHER, NO_MODULE
            if self.marks is not None and (phase, mod) != self._last_mark:
                self._last_mark = (phase, mod)
                self.marks.append({"time_us": time.time_ns() // 1000, "module": scope.name(mod) if mod >= 0
                                   else None, "phase": PHASES[phase]})
        except Exception as e:  # a hook must never kill training
            node, phase, mod = None, FORWARD, NO_MODULE
            self._error(func, e)
        if run is not None:
            if types and _has_wrapper(types):    # not expected attached (see ``attach``): the
                self._error(func, RuntimeError(    # fake mode declines it, its local ops come next
                    "a tensor subclass op reached the fake mode; its local ops are counted"))
                return run(func, types, args, kwargs)
            out = run(func, types, args, kwargs)
        elif types and _has_wrapper(types):    # a DTensor op: see the collectives it issues inside
            with InnerCollectives(self, phase, mod, is_wrapper_subclass):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out, node, phase, mod)
        except Exception as e:
            self._error(func, e)
        return out

    def attach(self, fake_mode, life, thread: int) -> None:
        """Observe the step from inside ``fake_mode`` rather than as a mode above it: its
        ``dispatch`` (looked up on the instance by ``FakeTensorMode.__torch_dispatch__``) is
        wrapped for the step, so each op crosses into Python once instead of twice. The ops
        seen are the same: those that reach the fake mode from above, on the tracing thread
        (not the ones it runs itself for a decomposition: ``_inside``). For a step whose only
        dispatch mode is ``fake_mode`` (see ``StepTracer``), where a mode pushed above it
        would be next in line anyway. One difference: a FakeTensorMode the step enters itself
        takes the fake mode's place while it lasts, and its ops (on its own fake tensors:
        shape inference, not the step's work) are not seen, where a mode pushed above both
        saw them."""
        original = fake_mode.dispatch
        observe = self.__torch_dispatch__
        fake = self._fake

        def dispatch(func, types, args=(), kwargs=None):
            if func is _PRIM_DEVICE and len(args) == 1 and type(args[0]) is fake:
                a = args[0]              # FakeTensorMode's own answer (see __torch_dispatch__)
                return _META if a.fake_mode.in_kernel_invocation else a.fake_device
            if self._inside or get_ident() != thread:
                return original(func, types, args, kwargs)
            self._inside = True
            try:
                return observe(func, types, args, kwargs, original)
            finally:
                self._inside = False

        life.patch_instance(fake_mode, "dispatch", dispatch)

    def _unpack_detach(self, func, args) -> bool:
        """The op is the detach autograd makes of the saved tensor the tracer's unpack hook just
        returned (``StepTracer._unpack``): an op of the tracer's, not the step's. Autograd
        issues it because a hook is installed (``SavedVariable::unpack`` re-wraps the hook's
        result; without hooks it returns a saved input as it is), so it is not recorded: the
        views and copies of a traced step are those of the same step with no saved-tensor hooks
        (Llama-2-7B fake: 968 such detaches otherwise counted as backward views). Any other
        op ends the wait."""
        t, self.unpacked = self.unpacked, None
        return func is _DETACH and bool(args) and args[0] is t

    def _error(self, func, e) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{func}: {type(e).__name__}: {e}")

    def _record(self, func, args, kwargs, out, node, phase, mod):
        # NB: one long function on purpose (issue 34 splits the others): it runs once per traced
        # op, and each helper it called would add a Python call to every op of every step
        # (~30 ns a call with three arguments, timeit on CPython 3.11; six sections ~180 ns/op)
        idx = self.n_ops
        self.n_ops = idx + 1
        st = self.storages
        if st.dead:                     # storages freed since the last op died at op idx
            st.drain()
        st.now = idx + 1
        self.op_phase.append(phase)
        if phase != self._last_phase:
            self._last_phase = phase
            self.phase_changes.append((idx, phase))
            if self.on_phase is not None:
                self.on_phase(phase)

        fid = id(func)                  # ops hash in Python; their ids hash in C
        if fid in self.collective_ids:  # never FLOPs, never uncounted, never a copy
            self.op_module.append(mod)
            self._collective(func, args, kwargs, out, phase, mod, idx)
            return
        info = self._finfo.get(fid)
        if info is None:
            info = self._static(func, fid)
        alias, handler = info[0], info[5]
        if info[6] and self._view_checked.get(fid):
            # a view (alias op, no formula but "free", confirmed by storage identity): no FLOPs,
            # no bytes, no storage; what the general path below does for it, in short
            self.op_module.append(mod)
            self.op_func.append(fid)
            self.op_flops.append(0)
            key = (phase, mod, fid)
            row = self.agg.get(key)
            if row is None:
                row = self._new_row(key)
                if fid not in self.kinds:
                    self.kinds[fid] = "free"
            self.agg_vals[row] += 1
            self.views[phase] += 1
            if info[3] and self.grad_watch:
                self._zeroed(args[0])
            if self._copied and info[2] and phase == FORWARD:
                self._check_undone(args, out)
            return

        if info[7] and type(out) in PLAIN:    # pointwise, one plain output (most ops): a FLOP an
            fc, kind, pointwise = None, "elementwise", out.numel()     # element (flops.py)
        else:
            fc = handler(args, kwargs, out) if handler is not None else None
            kind = fc.kind if fc is not None else None
        if fc is not None and fc.flops:
            wrapper = _WRAPPERS.get(type(out))
            if wrapper is None:
                wrapper = is_wrapper_subclass(type(out))
            if wrapper:                 # DTensor op: this rank's share
                fc = _local_flops(fc, out)
        if kind == "matmul":
            if phase == FORWARD and not self.sdpa_depth:
                fc = self._unwrapped_sdpa(func, fc, mod)
            elif self.sdpa_depth or self.attn_ranges:
                causal = self._in_attention(phase, node)
                if causal is not None:  # a matmul of the SDPA math path: attention, not a layer
                    fc = FlopCount("attention", fc.flops, fc.flops // 2 if causal else fc.flops)
            kind = fc.kind
            if kind == "attention":
                func = self._as_math_attention(func)
                fid = id(func)
            elif phase == FORWARD and mod >= 0:
                mod = self._weight_module(args, mod)
        elif func is _SAFE_SOFTMAX and phase == FORWARD and not self.sdpa_depth:
            self._unwrapped_sdpa(func, fc, mod)
        matmul = kind == "matmul" or kind == "attention"
        self.op_module.append(mod)
        self.op_func.append(fid)
        self.op_flops.append(fc.flops if matmul else 0)
        key = (phase, mod, fid)
        row = self.agg.get(key)
        if row is None:
            row = self._new_row(key)
            if fid not in self.kinds:
                self.kinds[fid] = kind
        vals = self.agg_vals
        vals[row] += 1
        if kind is None:
            ukey = (fid, phase, mod)
            self.uncounted[ukey] = self.uncounted.get(ukey, 0) + 1
        elif matmul:
            vals[row + 1] += fc.flops
            vals[row + 2] += fc.flops_causal
            if kind == "attention":
                name = func.kernel_name if type(func) is MathAttention else func._schema.name.split("::")[-1]
                self.attention_kernels[name] = self.attention_kernels.get(name, 0) + 1
                if type(func) is not MathAttention:     # its explicit mask, if any (attn_masks.py)
                    note_mask(self.shape_log, fid, func, args, fc,
                              self.masks.state(func, args, kwargs or {}, self.scope.module(mod), self.scope.module(0)))
            elif phase == FORWARD:
                if self._note_matmul_params(args):
                    self.param_matmul_flops += fc.flops
                    self.param_grad_flops += fc.flops * grads_needed(func, args)
        elif kind == "elementwise":
            self.elementwise[phase] += pointwise if fc is None else fc.flops
        elif alias and self._is_view(func, args, out):   # no bytes move, no storage is made
            self.views[phase] += 1
            if info[3] and self.grad_watch:
                self._zeroed(args[0])
            if self._copied and info[2] and phase == FORWARD:
                self._check_undone(args, out)
            return

        track = not alias or self._view_checked.get(fid) is False   # an "alias" that copied
        try:
            read, written = self._io(args, out, track, idx, func, phase)
        except (RuntimeError, NotImplementedError):  # sparse: no nbytes, no single storage
            read, written = self._io(args, out, track, idx, func, phase, tensor_bytes, storages)
        vals[row + 3] += read
        vals[row + 4] += written
        if matmul:
            note_op(self.shape_log, fid, func, args, phase, mod, fc)   # shapes (opshapes.py)
        elif read or written:
            # a memory-bound op: it extends the open elementwise chain of its phase, or starts
            # one (opshapes.py's fused_bytes/fused_kernels; inline: every such op comes here)
            log = self.shape_log
            chain = log.chain
            if chain is not None and chain[0] == phase:
                chain[1] = key
                chain[2] = written
            else:
                if chain is not None:
                    close_chain(log)
                frow = log.fuse.get(key)
                if frow is None:
                    frow = log.fuse[key] = [0, 0]
                frow[0] += read
                frow[1] += 1
                log.chain = [phase, key, written]
        if info[1]:
            self._note_copy(func, args, kwargs, out, phase, mod, written)
        elif info[4] and phase != BACKWARD:
            self._note_gather(args, out)
        elif info[3] and self.grad_watch and (info[3] == 1 or (
                len(args) > 1 and type(args[1]) in (int, float) and args[1] == 0)):   # p.grad.mul_(0)
            self._zeroed(args[0])
        if phase == FORWARD and written:
            first = out if isinstance(out, _Tensor) else (out[0] if isinstance(out, tuple) and out else None)
            if isinstance(first, _Tensor) and first.dim() == 0:
                self.scalar_sites[idx] = user_frame()     # where a loss-like scalar was made

    def _new_row(self, key) -> int:
        """A new (phase, module, op) row, all zeros; its index."""
        row = self.agg[key] = len(self.agg_vals)
        self.agg_vals.extend(_ZERO_ROW)
        return row

    def agg_rows(self):
        """``((phase, module, id(func)), (count, flops, causal flops, read, written))`` per row."""
        vals = self.agg_vals
        for key, r in self.agg.items():
            yield key, tuple(vals[r:r + 5])

    def _static(self, func, fid) -> tuple:
        """What ``func``'s schema says, once per process (``_FINFO``): (aliases an input, is a
        copy, is a permute, zeroes (1) / scales (2), gathers, its FLOP formula, is a view op:
        an alias with the "free" formula, has the pointwise formula: a FLOP per output element)."""
        info = _FINFO.get(fid)
        if info is None:
            alias, handler = _is_alias_op(func), handler_of(func)
            info = _FINFO[fid] = (alias, func in _COPY_OPS, func in _PERMUTE_OPS,
                                  1 if func in _ZERO_OPS else 2 if func in _MUL_OPS else 0,
                                  func in _GATHER_OPS, handler, alias and is_free(handler),
                                  is_pointwise(handler) and func is not _SAFE_SOFTMAX)
            _PINNED.append(func)
        self._finfo[fid] = info
        self.funcs[fid] = func
        return info

    def _io(self, args, out, track, idx, func, phase, nbytes=_Tensor.nbytes.__get__, storages=None):
        """Bytes read and written by an op; tracks the storages it made when ``track``. The
        default reads ``.nbytes`` and one storage per tensor (fast); the caller retries with
        ``memory.tensor_bytes``/``memory.storages`` for tensors without one (sparse)."""
        read = 0
        wrappers = _WRAPPERS
        for a in args:
            cls = type(a)
            if cls in PLAIN:                    # the common case first
                read += nbytes(a)
            elif isinstance(a, _Tensor):
                wrapper = wrappers.get(cls)
                if wrapper is None:
                    wrapper = is_wrapper_subclass(cls)
                read += tensor_bytes(a) if wrapper else nbytes(a)   # a DTensor reads its local shard
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if type(b) in PLAIN:
                        read += nbytes(b)
                    elif isinstance(b, _Tensor):    # a list of DTensors (foreach ops): local shards
                        wrapper = wrappers.get(type(b))
                        if wrapper is None:
                            wrapper = is_wrapper_subclass(type(b))
                        read += tensor_bytes(b) if wrapper else nbytes(b)
        st = self.storages
        # the tensors a graph can be kept through (retention.py): forward and recomputation
        # outputs; no weakref for the others (each one feeds the gc)
        graph = phase == FORWARD or phase == RECOMPUTE
        if storages is None and type(out) in PLAIN:      # one plain output (most ops)
            if track:
                st.add(out.untyped_storage(), TEMP, idx, func, out if graph else None)
            return read, nbytes(out)
        written = 0
        for o in ((out,) if isinstance(out, _Tensor) else out if isinstance(out, (tuple, list)) else ()):
            if isinstance(o, _Tensor):
                cls = type(o)
                wrapper = wrappers.get(cls)
                if wrapper is None:
                    wrapper = is_wrapper_subclass(cls)
                if wrapper:                     # a DTensor: this rank's local shard
                    written += tensor_bytes(o)
                    if track:
                        for s in _storages_of(o):
                            st.add(s, TEMP, idx, func)
                    continue
                written += nbytes(o)
                if track:
                    if storages is None:
                        st.add(o.untyped_storage(), TEMP, idx, func, o if graph else None)
                    else:
                        for s in storages(o):
                            st.add(s, TEMP, idx, func, o if graph else None)
        return read, written

    def inner_collective(self, func, args, kwargs, out, phase, mod) -> None:
        """A collective a DTensor op issued inside itself (``collectives.InnerCollectives``):
        recorded under that op's phase and module, at the index it is about to take."""
        self._collective(func, args, kwargs, out, phase, mod, self.n_ops)

    def _collective(self, func, args, kwargs, out, phase, mod, idx) -> None:
        """One collective (or a wait on one): its output storages are tracked like any op's
        (a functional all-gather makes its result); a data-moving one becomes an event."""
        for o in _operands(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, _Tensor):
                for s in storages(o):
                    self.storages.add(s, TEMP, at=idx, op=func)
        if func in IGNORED:
            if self.on_collective is not None and func.__name__.startswith("split_with_sizes_copy"):
                self.on_collective(FSDP_COPY_OUT, func, args, kwargs, out)
            return
        op, n, span, nbytes = describe(func, args, kwargs, out)
        if phase == OTHER and _graph_task() != -1:    # an engine's final callback (FSDP2's last
            phase = BACKWARD                            # reduce-scatters): still the backward
        if phase == BACKWARD and mod == NO_MODULE:
            mod = self._post_backward_unit()
        key = (op, n, span, phase, mod, user_frame(_COLLECTIVE_SKIP))
        row = self.collectives.get(key)
        if row is None:
            row = self.collectives[key] = [0, 0, 0, 0, 0]
        row[0] += 1
        row[1] += nbytes["bytes"]
        row[2] += nbytes["bytes_received"]
        row[3] += nbytes["algo_bytes"]
        row[4] += nbytes["bus_bytes"]
        if self.on_collective is not None:
            self.on_collective(op, func, args, kwargs, out)

    def _post_backward_unit(self) -> int:
        """The module a collective issued in backward outside every module's nodes belongs
        to: the FSDP2 unit whose ``post_backward`` is on the stack (the root's, run by the
        engine's final callback: its forward's inputs need no gradient, so its hook never
        fires), else the model (a reducer's final flush)."""
        f = sys._getframe(2)
        for _ in range(_UNIT_FRAMES):
            if f is None:
                break
            if f.f_code.co_name == "post_backward":
                modules = getattr(f.f_locals.get("self"), "modules", None)
                if isinstance(modules, (tuple, list)) and modules:
                    i = self.scope.index_of(modules[0])
                    if i != NO_MODULE:
                        return i
            f = f.f_back
        return 0

    def _life(self, t):
        """``t``'s storage by identity that dies with it: the storage's lifetime index while the
        tracker follows it (a storage freed and another made at the same address are two
        lifetimes), else the storage's address as a tagged tuple (not tracked: never freed
        while the step is traced, e.g. a parameter, or a wrapper's outer storage)."""
        st = self.storages
        if st.dead:
            st.drain()
        key = t.untyped_storage()._cdata
        k = st.live.get(key)
        return k if k is not None else ("storage", key)

    def _is_view(self, func, args, out) -> bool:
        """The schema says ``func`` aliases its input; the first time each op is seen, confirm
        it by storage identity (an op that made new storage after all is tracked as a copy)."""
        ok = self._view_checked.get(id(func))
        if ok is None:
            src = args[0] if args and isinstance(args[0], _Tensor) else None
            dst = out if isinstance(out, _Tensor) else None
            ok = (src is None or dst is None      # a sparse tensor's _values() is in one of its storages
                  or not {s._cdata for s in storages(src)}.isdisjoint(s._cdata for s in storages(dst)))
            self._view_checked[id(func)] = ok
            if not ok:
                self._finfo[id(func)] = (False,) + self._finfo[id(func)][1:]
        return ok

    def _zeroed(self, arg) -> None:
        for t in (arg if isinstance(arg, (list, tuple)) else (arg,)):
            self.zeroed.update(s._cdata for s in storages(t))

    def _in_attention(self, phase, node):
        """None outside SDPA; else whether the SDPA call was causal."""
        if phase != BACKWARD:
            return self.sdpa_causal if self.sdpa_depth else None
        seq = node._sequence_nr()
        k = bisect_right(self._attn_starts, seq) - 1
        if k >= 0:
            start, end, causal = self.attn_ranges[k]
            if start <= seq < end:
                return causal
        return None

    def _check_undone(self, args, out):
        """A copy made contiguous and now permuted back to the layout it was copied from: the
        copy bought nothing. (A permute to some other layout is new work, e.g. K^T for Q K^T.)"""
        src = args[0]
        if isinstance(src, _Tensor) and isinstance(out, _Tensor) and not out.is_contiguous():
            hit = self._copied.get(self._life(src))
            if hit is not None and hit[0] in self.copies and _dim_order(out) == hit[1]:
                self.copies[hit[0]][2]["permuted_back"] = True

    def _note_matmul_params(self, args) -> bool:
        """Note the parameters this forward matmul multiplies; True if it has one."""
        ps = self.param_storages
        found = False
        for a in _operands(args[:3]):
            if isinstance(a, _Tensor) and a.dim() >= 2:     # operands, not biases
                local = getattr(a, "_local_tensor", None)   # a DTensor: this rank's part of it
                if local is not None:
                    if 0 < local.numel() < a.numel():        # split across ranks at the matmul:
                        self.tensor_parallel = max(self.tensor_parallel, round(a.numel() / local.numel()))
                    a = local                                # tensor parallelism (FSDP gathers first)
                try:
                    key = a.untyped_storage()._cdata
                except Exception:
                    continue
                if key in ps:
                    self.matmul_params.add(key)
                    found = True
                elif self.derived_params and (derived := self.derived_params.get(self._life(a))) is not None:
                    self.matmul_params.add(derived)      # autocast's bf16 copy of a weight
                    found = True
                elif key in self.gathered_params:         # FSDP2's all-gathered weight
                    self.matmul_params.add(key)     # its numel: the parameter's view, unpadded
                    self.gathered_params[key] = max(a.numel(), self.gathered_params[key] or 0)
                    found = True
        return found

    def _as_math_attention(self, func):
        """The stand-in op under which a matmul of SDPA's math path is recorded."""
        wrapped = self._math_attention.get(id(func))
        if wrapped is None:
            wrapped = self._math_attention[id(func)] = MathAttention(func)
            self.funcs[id(wrapped)] = wrapped
            self.kinds[id(wrapped)] = "attention"
        return wrapped

    def _unwrapped_sdpa(self, func, fc, mod):
        """SDPA's math path called past the wrapper (a reference bound before the trace):
        its softmax is ``aten._safe_softmax``, which only that path uses. The matmul just
        before it made the scores and the next one multiplies by V: both are attention
        (counted dense: whether the call was causal is not known here), forward and, through
        the autograd range they span, backward."""
        if func is _SAFE_SOFTMAX:
            last = self._last_matmul
            if last is not None:
                key, flops, start = last
                row = self.agg.get(key)
                vals = self.agg_vals
                if row is not None and vals[row + 1] >= flops:      # move the scores to attention
                    vals[row] -= 1
                    vals[row + 1] -= flops
                    vals[row + 2] -= flops
                    akey = (key[0], key[1], id(self._as_math_attention(self.funcs[key[2]])))
                    arow = self.agg.get(akey)
                    if arow is None:
                        arow = self._new_row(akey)
                    vals[arow] += 1
                    vals[arow + 1] += flops
                    vals[arow + 2] += flops
                    if vals[row] == 0:         # it held only the scores: their bytes go along
                        vals[arow + 3] += vals[row + 3]
                        vals[arow + 4] += vals[row + 4]
                        del self.agg[key]
                    self.attention_kernels["math"] = self.attention_kernels.get("math", 0) + 1
                    self._scores_start = start
            self._last_matmul = None
            return fc
        if self._scores_start is not None:                   # x V: the end of the call
            start, self._scores_start = self._scores_start, None
            self.attn_ranges.append((start, _get_sequence_nr(), False))
            self._attn_starts.append(start)
            self._last_matmul = None
            return FlopCount("attention", fc.flops, fc.flops)
        self._last_matmul = ((FORWARD, mod, id(func)), fc.flops, _get_sequence_nr() - 1)
        return fc

    def _weight_module(self, args, mod: int) -> int:
        """A forward matmul run by ``mod`` with the weight of a module inside it, which ``mod``
        uses without calling it (``nn.MultiheadAttention`` with ``out_proj.weight``), is that
        module's work, and so is its backward."""
        scope = self.scope
        owners = scope.storage_owner
        for a in _operands(args[:3]):
            if isinstance(a, _Tensor) and a.dim() >= 2:
                key = a.untyped_storage()._cdata
                owner = owners.get(key)
                if owner is None and self.derived_params:            # autocast's copy of it
                    derived = self.derived_params.get(self._life(a))
                    if derived is not None:
                        owner = owners.get(derived)
                if owner is not None and owner != mod and scope.is_ancestor(mod, owner):
                    if _grad_enabled() and _needs_grad(args[:3]):
                        scope.owns_node(owner)
                    return owner
        return mod

    def _note_gather(self, args, out) -> None:
        """Matrices picked out of a stacked weight (``experts.w[expert_ids]``, MoE's batched
        path) are that weight when a matmul multiplies them. Only stacks of matrices (3+
        dims): rows picked from a 2-D table are embeddings, an input to matmuls, not a weight."""
        src = args[0] if args else None
        if isinstance(src, _Tensor) and isinstance(out, _Tensor) and src.dim() >= 3:
            key = src.untyped_storage()._cdata
            if key in self.param_storages:
                self.derived_params[self._life(out)] = key

    def _note_copy(self, func, args, kwargs, out, phase, mod, nbytes):
        src = args[1] if func is _aten.copy_.default else args[0]
        dst = out if isinstance(out, _Tensor) else None
        if not isinstance(src, _Tensor) or dst is None:
            return
        if func is _aten._to_copy.default or func is _aten.copy_.default:
            prefix = "" if func is _aten._to_copy.default else "copy_ "
            if dst.dtype != src.dtype:
                reason = f"{prefix}dtype {_short(src.dtype)}->{_short(dst.dtype)}"
            elif dst.device != src.device:
                reason = f"{prefix}device {src.device.type}->{dst.device.type}"
            else:
                reason = prefix.strip() or "to() copy"
        else:
            reason = "contiguous of non-contiguous" if not src.is_contiguous() else "clone"
        if func is _aten._to_copy.default and phase != BACKWARD:
            key = src.untyped_storage()._cdata
            if key in self.param_storages:              # e.g. autocast casting a weight
                self.derived_params[self._life(dst)] = key
            elif self.derived_params:
                derived = self.derived_params.get(self._life(src))
                if derived is not None:
                    self.derived_params[self._life(dst)] = derived
        loc = user_frame() if phase != BACKWARD else None   # backward runs in the engine
        key = (func.__name__, mod, phase, loc, reason)
        row = self.copies.get(key)
        if row is None:
            row = self.copies[key] = [0, 0, {"src_shape": list(src.shape), "src_stride": list(src.stride()),
                                               "dtype": _short(dst.dtype)}]
        row[0] += 1
        row[1] += nbytes
        if reason == "contiguous of non-contiguous" and phase != BACKWARD and 0 not in src.stride():
            # NB: a source with a zero stride (expand) must be materialised to be reshaped:
            # that copy is needed whatever follows, so it is never "permuted back"
            if len(self._copied) > 256:
                self._copied.clear()
            self._copied[self._life(dst)] = (key, _dim_order(src))
        if reason.startswith("dtype") and phase != BACKWARD:
            self._note_cast(key, src, dst, row, nbytes)

    def _note_cast(self, key, src, dst, row, nbytes) -> None:
        """Dtype round trips by data flow: a cast whose input is the output of an earlier cast
        from the dtype it now casts back to (``x.to(bf16).to(fp32)``). A norm that computes in
        fp32 and casts its *result* back is not one: that result is a new value."""
        live = self.storages.live
        first = self._casts.get(live.get(src.untyped_storage()._cdata, -1))
        if first is not None and first[1] == dst.dtype:
            trip = row[2].setdefault("round_trip", {"from": list(first[0][3:5]), "events": 0, "bytes": 0})
            trip["events"] += 1
            trip["bytes"] += src.nbytes + nbytes
        k = live.get(dst.untyped_storage()._cdata)
        if k is not None:
            if len(self._casts) > 4096:
                self._casts.clear()
            self._casts[k] = (key, src.dtype)


def _operands(args):
    """The tensors among a matmul-class op's leading arguments; a list is opened (the weights
    of a fused recurrent layer: ``_cudnn_rnn(input, [w_ih, w_hh, b_ih, b_hh, ...], ...)``)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


_storages_of = storages
_WRAPPERS: dict = {}


def is_wrapper_subclass(cls) -> bool:
    """``cls`` is a wrapper subclass whose data sits in inner tensors (DTensor): its own
    ``untyped_storage()`` and ``nbytes`` describe the global tensor, not this rank's bytes."""
    hit = _WRAPPERS.get(cls)
    if hit is None:
        hit = _WRAPPERS[cls] = cls.__name__ == "DTensor" or (
            cls not in (_Tensor, torch.nn.Parameter) and cls.__name__ != "FakeTensor"
            and "__tensor_flatten__" in {k for c in cls.__mro__ for k in vars(c)}
            and cls.__module__.startswith("torch.distributed"))
    return hit


_HAS_WRAPPER: dict = {}    # the ``types`` a dispatch is given -> whether one is a wrapper


def _has_wrapper(types) -> bool:
    hit = _HAS_WRAPPER.get(types)
    if hit is None:
        hit = any(is_wrapper_subclass(cls) for cls in types)
        try:
            _HAS_WRAPPER[types] = hit
        except TypeError:           # not hashable: not kept
            pass
    return hit


def _local_flops(fc, out):
    """A DTensor op's FLOPs on this rank. ``op_flops`` saw the global shapes; the rank computes
    its local output (a share local/global numel of it) and, when that output is Partial (a
    row-wise parallel matmul: the reduction dimension is sharded), only 1/n of each sum."""
    try:
        share = out._local_tensor.numel() / max(out.numel(), 1)
        mesh = out.device_mesh
        for i, p in enumerate(out.placements):
            if p.is_partial():
                share /= mesh.size(i)
    except Exception:           # not a DTensor after all: its FLOPs as counted
        return fc
    return fc._replace(flops=int(fc.flops * share), flops_causal=int(fc.flops_causal * share))


def _dim_order(t) -> tuple:
    """``t``'s dims from the outermost (largest stride) to the innermost, its layout in
    memory; dims of size 1 have no place in it (their stride is arbitrary)."""
    stride = t.stride()
    dims = [i for i, n in enumerate(t.shape) if n != 1]
    return (t.dim(),) + tuple(sorted(dims, key=lambda i: -stride[i]))


class MathAttention:
    """Stands for a matmul op run inside ``scaled_dot_product_attention``'s math path."""

    kernel_name = "math"

    def __init__(self, func):
        self.func = func

    def __str__(self) -> str:
        return f"{self.func} (attention, SDPA math path)"


def attention_hook(mode, life, ours) -> None:
    """Wrap ``F.scaled_dot_product_attention`` for the trace so that the matmuls of its math
    path (meta device, dropout, masks the fused kernels refuse) count as attention. Calls on
    threads that are not the step's (``ours()`` false) go straight to the original.

    NB: code that bound the function before the trace (``from torch.nn.functional import
    scaled_dot_product_attention``) bypasses the wrapper; ``LedgerMode._unwrapped_sdpa`` still
    finds its math path by its softmax, without knowing whether it was causal.
    """
    import torch.nn.functional as F
    from torch._C._autograd import _get_sequence_nr

    original = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        if not ours():
            return original(*args, **kwargs)
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        masks = mode.masks
        outer = (mode.sdpa_depth, mode.sdpa_causal, masks.bool_call)
        mode.sdpa_depth += 1
        mode.sdpa_causal = causal
        masks.bool_call = getattr(mask, "dtype", None) is torch.bool    # attn_masks.MaskFacts
        start = _get_sequence_nr()
        try:
            return original(*args, **kwargs)
        finally:
            mode.sdpa_depth, mode.sdpa_causal, masks.bool_call = outer
            end = _get_sequence_nr()
            if end > start:
                mode.attn_ranges.append((start, end, causal))
                mode._attn_starts.append(start)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.__doc__ = original.__doc__
    life.patch(F, "scaled_dot_product_attention", scaled_dot_product_attention)


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


__all__ += ["FORWARD", "BACKWARD", "RECOMPUTE", "OPTIMIZER", "OTHER", "NO_MODULE", "user_frame", "attention_hook"]
