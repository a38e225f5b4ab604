"""The audit engine behind ``torchledger audit FILE.py``: load the user's model file, build
its spec on the chosen device, run and trace ``steps`` training steps, and hand back the
records. Every failure the user can cause becomes an ``AuditError`` with one line that says
what was expected, what arrived and what to do; the CLI prints it and exits 2.

Devices: ``fake`` (default) runs the step on FakeTensors with CPU kernels, so a 7B model
audits on a laptop with no real memory; ``meta`` runs on the meta device (attention takes
the math path); ``cpu`` and ``cuda`` run the real step.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
import types
from typing import Optional

from .record import TOKENS_FROM_SPEC
from .spec import AuditError, _call, infer_tokens, pick_loss, tokens_warning

__all__ = ["AuditRun", "load_entry", "run_audit", "DEVICES", "stdout_to_stderr"]

DEVICES = ("fake", "meta", "cpu", "cuda")

#: What the model file's code may raise that the audit reports as one line (not
#: KeyboardInterrupt: Ctrl-C stops the audit). GeneratorExit too: a BaseException, not an Exception.
USER_ERRORS = (Exception, SystemExit, GeneratorExit)


class AuditRun:
    """The outcome of an audit: the traced records and what the run was."""

    def __init__(self, records, spec, device, path):
        self.records, self.spec, self.device, self.path = records, spec, device, path

    @property
    def record(self):
        return self.records[-1]


@contextlib.contextmanager
def stdout_to_stderr():
    """While the user's code runs, what it writes to stdout goes to stderr, so that stdout
    holds the report alone (``audit --format json | jq``): Python's ``print`` through
    ``sys.stdout``, and C/C++ writes to file descriptor 1 (torch's own ``printf``) too.
    """
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    saved = None
    try:
        sys.__stdout__.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError, AttributeError):   # no fd 1 or 2 (an embedded interpreter)
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.__stdout__.flush()
            os.dup2(saved, 1)
            os.close(saved)


# -- loading the model file ----------------------------------------------------------------------
def load_entry(path: str, entry: str = "audit_spec"):
    """Import ``path`` as a module and return its ``entry`` function."""
    if not os.path.exists(path):
        raise AuditError(f"{path}: no such file; expected a Python model file that defines {entry}()")
    if os.path.isdir(path):
        raise AuditError(f"{path} is a directory; expected a Python model file that defines {entry}()")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        source = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AuditError(f"{path} is not a Python source file (not UTF-8 text); expected a .py model "
                         f"file that defines {entry}()") from None
    if b"\x00" in raw:
        raise AuditError(f"{path} is not a Python source file (binary data); expected a .py model file")
    try:
        code = compile(source, path, "exec")
    except SyntaxError as e:
        raise AuditError(f"{path}:{e.lineno}: syntax error: {e.msg}; fix the model file and rerun") from None
    module = types.ModuleType("torchledger_audit_model")
    module.__file__ = os.path.abspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    # registered, as an import would: a dataclass in a file with `from __future__ import
    # annotations` looks its module up in sys.modules while the class is made
    sys.modules[module.__name__] = module
    try:
        exec(code, module.__dict__)
    except USER_ERRORS as e:
        raise AuditError(f"{_where(e, path)}: importing the model file {_raised(e)}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    fn = module.__dict__.get(entry)
    if fn is None:
        found = [k for k, v in module.__dict__.items() if callable(v) and not k.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        hint = f" (functions defined there: {', '.join(found[:8])})" if found else ""
        raise AuditError(f"{path}: no function {entry!r}; define `def {entry}(): return "
                         f"torchledger.AuditSpec(model, inputs)` or pass --entry NAME{hint}")
    if not callable(fn):
        raise AuditError(f"{path}: {entry!r} is a {type(fn).__name__}, expected a function that "
                         f"returns a torchledger.AuditSpec")
    return fn


# -- devices ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def device_context(device: str):
    """The context the spec is built and the steps run in."""
    import torch
    if device == "fake":
        from .tracer.fake import fake_mode     # a deep-copied layer keeps the mode (and its weights)
        with fake_mode(allow_non_fake_inputs=True):
            yield
    elif device == "meta":
        with torch.device("meta"):
            yield
    elif device == "cuda":
        if not torch.cuda.is_available():
            raise AuditError("--device cuda: no CUDA device on this machine; use --device fake "
                             "(the default) to audit without a GPU")
        with torch.device("cuda"):
            yield
    elif device == "cpu":
        yield
    else:
        raise AuditError(f"--device: expected one of {', '.join(DEVICES)}, got {device!r}")


def _to_device(x, device: str):
    import torch
    if device not in ("meta", "cuda"):
        return x
    target = torch.device(device)
    if isinstance(x, torch.Tensor):
        return x.to(target) if x.device.type != device else x
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


#: torch loggers that print their own traceback (``log.exception``) for an error the audit
#: reports anyway as one line: a fake kernel failing on a shape mismatch ("failed while
#: attempting to run meta for aten.mm.default"), a symbolic shape guard. They are quiet while
#: an audit runs unless ``torch_logs=True`` (``--debug``).
TORCH_LOGGERS = ("torch._subclasses.fake_tensor", "torch._subclasses.meta_utils",
                 "torch.fx.experimental.symbolic_shapes", "torch.fx.experimental.proxy_tensor")


@contextlib.contextmanager
def quiet_torch_logs(enabled: bool = True):
    """Raise :data:`TORCH_LOGGERS` above ERROR for the block; their levels are restored after."""
    import logging
    if not enabled:
        yield
        return
    import torch._subclasses.fake_tensor  # noqa: F401  (importing torch resets its loggers' levels)
    saved = [(logger, logger.level) for logger in map(logging.getLogger, TORCH_LOGGERS)]
    for logger, _ in saved:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def run_audit(path: str, entry: str = "audit_spec", device: str = "fake", steps: int = 3,
              peak_flops=None, timing_steps: Optional[int] = None, torch_logs: bool = False,
              world_size: Optional[int] = None, mesh=None, plan: Optional[dict] = None) -> AuditRun:
    """Load, build, run and trace ``steps`` training steps; returns an ``AuditRun``.

    torch's own error logs of a failing fake kernel are silenced meanwhile (the failure comes
    back as one ``AuditError``) unless ``torch_logs`` is true.

    On ``cpu``/``cuda`` the MFU's step time comes from untraced steps after the traced ones
    (:func:`time_untraced`): ``timing_steps`` of them, or by default as many as make a steady
    median (3 to 20); 0 times none (MFU then from the traced steps, tracer overhead included).

    ``world_size`` and/or ``mesh`` (``"8x8"`` or a tuple) simulate that many ranks
    (:mod:`torchledger.world`): the step runs as rank 0 under a fake process group, after
    ``AuditSpec.parallelize(model, mesh)``; the process group is gone when this returns.
    """
    with quiet_torch_logs(not torch_logs), _same_cwd():
        world = _resolve_world(world_size, mesh, device)
        layout = _layout(world, mesh, plan)
        if world is None:
            return _run_audit(path, entry, device, steps, peak_flops, timing_steps, layout=layout)
        from .world import WorldError, fake_world
        try:
            if layout.pipelined:
                from .parallel.pipeline import run_pipeline_audit
                return run_pipeline_audit(path, entry, world, layout)
            with fake_world(*world, names=layout.names) as device_mesh:
                return _run_audit(path, entry, device, steps, peak_flops, timing_steps,
                                  world=(world, device_mesh), layout=layout)
        except WorldError as e:
            raise AuditError(str(e)) from None


def _layout(world, mesh, plan):
    """The run's :class:`~torchledger.parallel.layout.Layout` (named dims and plan options), or
    None for a plain single-process audit with no plan options."""
    options = {k: v for k, v in (plan or {}).items() if v is not None}
    if world is None and not options:
        return None
    from .parallel.layout import parse_layout
    from .world import WorldError
    try:
        layout = parse_layout(mesh if mesh is not None else None, world[0] if world else 1)
        layout = layout.with_options(**options)
        if not layout.pipelined:
            # NB: --micro-batches/--global-batch without pp are gradient accumulation: the
            # record is one micro-batch's step and says how many the step accumulates
            given = [f for f, k in (("--virtual-stages", "virtual_stages"), ("--schedule", "schedule"))
                     if k in options and not (k == "virtual_stages" and options[k] == 1)]
            if given:
                raise WorldError(f"{', '.join(given)}: pipeline options, and the mesh has no pp dimension; "
                                 f"give --mesh with pp=N (e.g. --mesh dp=2,pp=4) or drop them")
    except WorldError as e:
        raise AuditError(str(e)) from None
    return layout


@contextlib.contextmanager
def _same_cwd():
    """The working directory as it was, whatever the model file did with it (``os.chdir``)."""
    cwd = os.getcwd()
    try:
        yield
    finally:
        _restore_cwd(cwd)


def _restore_cwd(cwd: str) -> None:
    with contextlib.suppress(OSError):
        if os.getcwd() != cwd:
            os.chdir(cwd)


def _resolve_world(world_size, mesh, device):
    if world_size is None and mesh is None:
        return None
    from .world import WorldError, resolve_world
    try:
        return resolve_world(world_size, mesh, device)
    except WorldError as e:
        raise AuditError(str(e)) from None


def _standard_plan(model, device_mesh, layout, path: str, seq_len=None, **kw):
    """The standard plan of ``layout`` (:mod:`torchledger.parallel.plan`); (model, notes)."""
    from .parallel.plan import PlanError, apply_standard_plan
    try:
        return apply_standard_plan(model, device_mesh, layout, seq_len=seq_len, **kw)
    except PlanError as e:
        raise AuditError(f"{path}: {e}") from None
    except (Exception, SystemExit) as e:
        raise AuditError(f"{path}: the standard plan for --mesh {layout.text()} {_raised(e)}; give "
                         f"AuditSpec(parallelize=fn) with your own plan") from None


def _parallelize(spec, model, world, path: str, layout=None, seq_len=None):
    """``AuditSpec.parallelize(model, mesh)`` at a simulated world size, else the standard
    plan of the layout; (model, plan notes)."""
    import torch
    (n, shape), device_mesh = world
    fn = spec.parallelize
    if fn is None:
        if n == 1 and (layout is None or (layout.checkpointing == "none" and layout.precision == "fp32")):
            return model, []
        return _standard_plan(model, device_mesh, layout, path, seq_len)
    try:
        out = fn(model, device_mesh)
    except USER_ERRORS as e:
        raise AuditError(f"{_where(e, path)}: AuditSpec.parallelize(model, mesh) {_raised(e)} (mesh "
                         f"{'x'.join(map(str, shape))}, dims {', '.join(device_mesh.mesh_dim_names or ())})"
                         ) from None
    if not isinstance(out, torch.nn.Module):
        raise AuditError(f"{path}: AuditSpec.parallelize(model, mesh) returned {type(out).__name__}, "
                         f"expected the nn.Module (fully_shard returns it: end with `return model`)")
    return out, ["AuditSpec.parallelize (the model file's own plan)"]


def _accumulated(layout, count) -> Optional[int]:
    """Micro-batches a step accumulates without pipeline parallelism (``--micro-batches M`` or
    ``--global-batch G`` = M x dp x the spec's batch): ``totals.micro_batches``; the record is
    one micro-batch's forward and backward and the optimizer step."""
    if layout is None or layout.pipelined or (layout.micro_batches is None and layout.global_batch is None):
        return None
    if layout.micro_batches is not None:
        return layout.micro_batches
    batch = count.tokens // count.seq_len if count.tokens and count.seq_len else 1
    per = layout.dp_degree * batch
    if layout.global_batch % per:
        raise AuditError(f"--global-batch {layout.global_batch}: not a multiple of dp x the spec's batch "
                         f"({layout.dp_degree} x {batch} = {per}); the spec's inputs are one micro-batch")
    return layout.global_batch // per


def _cp_part(inputs, spec, layout, world):
    """Rank 0's part of the sequence under the standard plan's context parallelism."""
    if layout is None or spec.parallelize is not None or layout.size("cp") == 1:
        return inputs
    from .parallel.plan import cp_inputs
    seq = infer_tokens(inputs).seq_len
    return cp_inputs(inputs, layout.size("cp"), 0, seq) if seq else inputs


def _run_audit(path, entry, device, steps, peak_flops, timing_steps, world=None, layout=None) -> AuditRun:
    import torch
    from .spec import as_spec
    from .ledger import Ledger

    if steps < 1:
        raise AuditError(f"--steps: expected a whole number >= 1, got {steps}")
    if timing_steps is not None and not (isinstance(timing_steps, int) and 0 <= timing_steps <= MAX_TIMING_STEPS):
        raise AuditError(f"--timing-steps: expected a whole number from 0 to {MAX_TIMING_STEPS}, got "
                         f"{timing_steps!r}")
    cwd = os.getcwd()
    fn = load_entry(path, entry)
    with device_context(device):
        try:
            with _fake_safe_init(device):
                raw = fn()
        except AuditError:
            raise
        except USER_ERRORS as e:
            raise AuditError(f"{_where(e, path)}: {entry}() {_raised(e)}"
                             f"{_device_hint(e, device)}") from None
        try:
            spec = as_spec(raw)
        except TypeError as e:
            raise AuditError(f"{path}: {entry}() must return a torchledger.AuditSpec; {e}") from None
        model = spec.model
        if device in ("meta", "cuda"):
            model = model.to(device)
        inputs = _to_device(spec.inputs, device)
        plan_notes = []
        if world is not None:
            model, plan_notes = _parallelize(spec, model, world, path, layout, infer_tokens(inputs).seq_len)
            inputs = _cp_part(inputs, spec, layout, world)
        elif layout is not None and spec.parallelize is None:      # --checkpointing/--precision alone
            model, plan_notes = _standard_plan(model, None, layout, path)
        count = infer_tokens(inputs, model)
        tokens = spec.tokens or count.tokens
        source = TOKENS_FROM_SPEC if spec.tokens else count.source
        guessed = None if spec.tokens else tokens_warning(inputs, model)
        seq = spec.seq_len or count.seq_len
        try:
            from .parallel.plan import make_optimizer
            opt = make_optimizer(spec.optimizer or torch.optim.AdamW, model, layout)
        except USER_ERRORS as e:
            raise AuditError(f"{_where(e, path)}: making the optimizer {_raised(e)}") from None
        _check_optimizer(opt, spec, path)
        if device == "meta":
            opt.step = _step_with_cpu_default(opt.step)
        ledger = Ledger(model, optimizer=opt, keep=max(steps, 1),       # every audited step
                        peak_flops=peak_flops if device in ("cpu", "cuda") else None)
        loss_source = []

        def step():
            try:
                source = _one_step(spec, model, inputs, opt)
                if not loss_source:
                    loss_source.append(source)
            except AuditError:
                raise
            except USER_ERRORS as e:
                raise _step_error(e, path, device, world, model) from None

        with _frozen_heap():
            for _ in range(steps):
                try:
                    with ledger.step(tokens=tokens, seq_len=seq, tokens_source=source):
                        step()
                except AuditError:
                    raise
                except USER_ERRORS as e:        # entering or leaving the tracer, not the step
                    raise AuditError(f"{_where(e, path)}: tracing the step {_raised(e)}; the model "
                                     f"file changes something the tracer relies on (torch's dispatch "
                                     f"modes, module or optimizer hooks): leave torch's own classes "
                                     f"unpatched") from None
        warmup = 0
        if device in ("cpu", "cuda"):       # untraced steps time the step for MFU
            warmup = time_untraced(ledger, step, timing_steps)
    _restore_cwd(cwd)                   # a model file that chdir'd: paths are the user's again
    from .render.sarif import spec_location
    spec_line = spec_location(path, entry)[1]        # SARIF points here; report never opens the file
    for r in ledger.records:
        r.meta["audit"] = {"file": os.path.relpath(path), "entry": entry, "device": device,
                           "steps": steps, "seq_len": seq, "spec_line": spec_line,
                           "loss": loss_source[0] if loss_source else None}
        if guessed and guessed not in r.warnings:
            r.warnings.append(guessed)
        if layout is not None:
            r.meta["audit"].update(precision=layout.precision, kernels=layout.kernels)
        if plan_notes:
            r.meta["audit"]["plan"] = list(plan_notes)
        if world is not None:        # simulated: rank 0 of n (the report says so)
            (n, shape), _ = world
            r.meta["audit"].update(world_size=n, mesh=list(shape), rank=0)
            if layout is not None:
                r.meta["audit"]["mesh_dims"] = list(layout.names)
                r.totals["parallel_dims"] = dict(layout.dims)      # {"dp": 4, "tp": 8, ...}
                if spec.parallelize is None and layout.size("cp") > 1:  # inputs cut to T/cp (_cp_part)
                    r.totals["context_parallel"] = layout.size("cp")
                # the references read the mesh (context parallel: keys of the whole sequence)
                from .analyzers.compare import record_predictions
                r.predictions = record_predictions(r)
            # NB: set, not defaulted: a tracer that reads the process group finds the same
            # rank and size, but no mesh unless one is current
            r.totals.update(rank=0, world_size=n, mesh=list(shape))
            if not str(r.meta.get("device") or "").startswith("fake"):
                # NB: the tracer reads the device off the first parameter, and a sharded one is
                # a DTensor (not a FakeTensor) around its fake shard; the step was fake, so no
                # MFU is read from its time
                r.meta["device"] = "fake (cpu)"
        accumulate = _accumulated(layout, count)
        if accumulate:
            r.totals["micro_batches"] = accumulate
    run = AuditRun(ledger.records, spec, device, path)
    run.snapshot = ledger.snapshot
    run.untraced_seconds = list(ledger.untraced_seconds)
    run.warmup_steps = warmup
    if run.untraced_seconds:
        run.record.totals["step_seconds_untraced"] = sorted(run.untraced_seconds)[len(run.untraced_seconds) // 2]
    set_mfu(run, {"peak_flops": peak_flops})
    return run


def set_mfu(run, options: dict) -> dict:
    """Store the report's one MFU in the last record (``analyzers.mfu.mfu_totals``), timed by
    the untraced steps when there are any; returns ``options`` with that time added."""
    from .analyzers.mfu import mfu_totals
    options = dict(options)
    if run.untraced_seconds:
        options.update(step_seconds=run.record.totals["step_seconds_untraced"],
                       untraced_steps=len(run.untraced_seconds),
                       untraced_seconds=list(run.untraced_seconds),    # how many, their spread
                       warmup_steps=getattr(run, "warmup_steps", 0))
    run.record.totals.update(mfu_totals(run.records, options))
    return options


#: Untraced steps timed for MFU when ``timing_steps`` is None: at least AUTO_MIN_STEPS, then
#: more until they add up to AUTO_SECONDS, at most AUTO_MAX_STEPS (a 5 ms step is timed 20
#: times, a 100 ms one 5 times, a 2 s one 3 times). One untimed warm-up step runs first.
AUTO_MIN_STEPS, AUTO_MAX_STEPS, AUTO_SECONDS = 3, 20, 0.5
MAX_TIMING_STEPS = 1000
WARMUP_STEPS = 1


def time_untraced(ledger, step, timing_steps: Optional[int] = None) -> int:
    """Time untraced steps for MFU (``ledger.time_step()``, on the ledger's clock): first
    :data:`WARMUP_STEPS` untimed (caches, the allocator, a compiled model's compile: the
    traced steps ran eagerly), then ``timing_steps`` timed ones, or with None as many as the
    AUTO_* rule asks. Returns the number of warm-up steps run (0 when none is timed)."""
    if timing_steps == 0:
        return 0
    for _ in range(WARMUP_STEPS):
        step()
    times = ledger.untraced_seconds
    start, n = len(times), 0
    while True:
        if timing_steps is not None:
            if n >= timing_steps:
                break
        elif n >= AUTO_MAX_STEPS or (n >= AUTO_MIN_STEPS and sum(times[start:]) >= AUTO_SECONDS):
            break
        with ledger.time_step():
            step()
        n += 1
    return WARMUP_STEPS


def _check_optimizer(opt, spec, path: str) -> None:
    """What ``AuditSpec.optimizer(params)`` returned must be an optimizer: a
    ``torch.optim.Optimizer``, or an object with its ``param_groups``, ``state`` (a mapping),
    ``step()`` and, for the default step, ``zero_grad()``."""
    import collections.abc

    import torch
    if isinstance(opt, torch.optim.Optimizer):
        return
    needed = {"param_groups": lambda v: isinstance(v, (list, tuple)),
              "state": lambda v: isinstance(v, collections.abc.Mapping),
              "step": callable}
    if spec.step is None:
        needed["zero_grad"] = callable
    missing = [name for name, ok in needed.items() if not ok(getattr(opt, name, None))]
    if not missing:
        return
    where = path
    code = getattr(spec.optimizer, "__code__", None)
    if code is not None and os.path.abspath(code.co_filename) == os.path.abspath(path):
        where = f"{os.path.relpath(path)}:{code.co_firstlineno}"
    shown = " ".join(repr(opt).split())
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    wants = ", ".join(n + "()" if n in ("step", "zero_grad") else n for n in needed)
    raise AuditError(f"{where}: AuditSpec.optimizer(params) returned {type(opt).__name__} ({shown}), "
                     f"expected a torch.optim.Optimizer or an object with {wants} (missing: "
                     f"{', '.join(missing)}); return one, e.g. "
                     f"`optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)`")


def _step_with_cpu_default(step):
    """``optimizer.step`` with the CPU as the default device, for meta audits.

    The step runs inside ``torch.device("meta")``; an optimizer that makes a scalar with no
    device and reads it back with ``.item()`` (Adam/AdamW's ``state["step"]`` on torch 2.11
    and 2.12; 2.13 says ``device="cpu"``) fails there. State made ``*_like`` a parameter
    stays on meta either way.
    """
    import functools

    import torch

    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        with torch.device("cpu"):
            return step(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def _frozen_heap():
    """While the audited steps run, what exists before them (torch, the model file's imports,
    the model: a Hugging Face 7B build leaves ~1M objects) sits in the gc's permanent
    generation (``gc.freeze``), so a full collection the steps trigger walks only what they
    made (measured: a 0.23 s collection inside a traced 7B step). Nothing is freed that would
    not be: the heap is unfrozen when the steps end. Left alone when something else in the
    process already froze objects (its freeze is not ours to undo)."""
    import gc
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _one_step(spec, model, inputs, opt) -> str:
    """One training step; returns where its loss came from (``meta.audit.loss``)."""
    if spec.step is not None:
        spec.step(model, inputs, opt)
        return "AuditSpec.step (the model file's own step)"
    out = _call(model, inputs)
    if spec.loss_fn is not None:
        loss, source = spec.loss_fn(out, inputs), "AuditSpec.loss_fn"
    else:
        loss, source = pick_loss(out)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return source


@contextlib.contextmanager
def _fake_safe_init(device: str):
    """While the spec is built on fake tensors: ``nn.init.trunc_normal_`` leaves them alone, as
    torch itself does for meta tensors (its rejection loop reads values: ``mask.any()``, which
    fake tensors do not have; ViT, DeiT and Swin initialise with it)."""
    import torch.nn.init as init
    original = getattr(init, "_no_grad_trunc_normal_", None)
    if device != "fake" or original is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def trunc_normal(tensor, *args, **kwargs):
        return tensor if isinstance(tensor, FakeTensor) else original(tensor, *args, **kwargs)

    init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original


def _device_hint(e: Exception, device: str) -> str:
    """What to try when a build or step failed because of the device it ran on."""
    name, text = type(e).__name__, _text(e)
    if device in ("fake", "meta") and "Expected inputs of BF16" in text:
        return (f"; torch's grouped_mm (mixture-of-experts layers) checks for bf16 inputs on {device} "
                f"tensors (only its CPU kernel takes float32): build the model in bf16 "
                f"(torch.set_default_dtype(torch.bfloat16) at the top of audit_spec(), or "
                f"dtype=torch.bfloat16 in its constructor), or use --device cpu; a Hugging Face MoE "
                f"decoder (Mixtral, Qwen2/3-MoE, GPT-OSS, DeepSeek-V2/V3) also runs under the standard "
                f"plan (--precision fp32 or --mesh), which computes its experts with batched matmuls "
                f"under balanced routing")
    if device == "fake" and "Couldn't swap" in text and _memory_format_call(e):
        return ("; fake tensors cannot change a model's memory format in place "
                "(model.to(memory_format=...)): leave the model as built and pass channels_last "
                "inputs (x.to(memory_format=torch.channels_last)): the convolutions then run "
                "channels_last with the numbers of --device cpu; or use --device cpu")
    if device == "fake" and "Couldn't swap" in text:
        return ("; fake tensors cannot convert parameters in place (model.to(dtype)): build the "
                "model in its dtype (torch.set_default_dtype, or dtype= in its constructor) or use "
                "--device meta")
    if device == "fake" and ("Fake" in name or "DataDependent" in name or "DynamicOutputShape" in name):
        return "; fake tensors have no values: try --device cpu (or --device meta)"
    if device == "meta" and ("meta tensor" in text or "DataDependent" in name):
        return "; meta tensors have no values and this reads one: try --device cpu (or --device fake)"
    return ""


def _memory_format_call(e: BaseException) -> bool:
    """True when a frame of the user's code (not torch's) asked for a memory format conversion."""
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in traceback.extract_tb(e.__traceback__):
        if os.path.abspath(frame.filename).startswith(torch_dir + os.sep):
            continue
        if "memory_format" in (frame.line or "") or "channels_last" in (frame.line or ""):
            return True
    return False


def _layout_hint(e: BaseException, device: str) -> str:
    """What to do when PyTorch's own pipeline schedules or context parallelism fail on fake
    tensors: torchledger simulates both itself (``--mesh ...,pp=N`` / ``cp=N``)."""
    text = str(e)
    frames = traceback.extract_tb(e.__traceback__)
    if device == "fake" and any("distributed" + os.sep + "pipelining" in fr.filename for fr in frames):
        return ("; PyTorch's pipelining schedules cannot run on fake tensors (their p2p reads values): "
                "drop the schedule from the step and give --mesh with pp=N (e.g. --mesh dp=2,pp=4 "
                "--micro-batches 8): torchledger cuts the blocks into stages and composes the schedule")
    if "does not have a sharding strategy registered" in text:
        if "scaled_dot_product" in text:
            return ("; PyTorch's context_parallel has no sharding rule for the CPU attention kernel fake "
                    "tensors run: drop context_parallel from the step and give --mesh with cp=N and no "
                    "AuditSpec.parallelize (the standard plan all-gathers K/V over cp)")
        return ("; DTensor has no sharding rule for this op: keep it out of DTensor regions (to_local() "
                "around it) or run the plan without that parallel dimension")
    return ""


def _step_error(e: BaseException, path: str, device: str, world=None, model=None) -> AuditError:
    name = type(e).__name__
    if isinstance(e, SystemExit):
        return AuditError(f"{_where(e, path)}: the training step {_raised(e)}; the model, loss_fn and "
                          f"step must return (or raise), not exit")
    split = _mesh_split_hint(e, world, model)
    if split:
        return AuditError(f"{_where(e, path)}: {split} (the step raised {name}: {_msg(e)})")
    layout = _layout_hint(e, device)
    if layout:
        return AuditError(f"{_where(e, path)}: the step cannot run on {device} tensors ({name}: "
                          f"{_msg(e)}){layout}")
    hint = _device_hint(e, device) or (
        "; try --device cpu (or --device meta)" if device == "fake" and "fake" in _text(e).lower()[:200] else "")
    if hint:
        return AuditError(f"{_where(e, path)}: the step cannot run on {device} tensors ({name}: "
                          f"{_msg(e)}){hint}")
    return AuditError(f"{_where(e, path)}: the training step raised {name}: {_msg(e)}; check the "
                      f"inputs your audit_spec() returns against what the model expects")


#: Config fields that tensor parallelism splits: (name, what it is). Ours, then Hugging Face's.
_SPLIT_FIELDS = (("n_heads", "attention heads"), ("n_kv_heads", "key/value heads"),
                 ("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"),
                 ("d_model", "hidden size"), ("hidden_size", "hidden size"), ("d_ff", "MLP width"),
                 ("intermediate_size", "MLP width"))


def _mesh_split_hint(e: BaseException, world, model) -> str:
    """A shape error under tensor parallelism: which model dimension does not divide which mesh
    dimension (one line), or "" when that is not what happened."""
    text = str(e)
    if world is None or model is None or not (
            ("shape '[" in text and "is invalid for input of size" in text) or "view size is not compatible" in text
            or "does not divide" in text):
        return ""
    try:
        names = tuple(world[1].mesh_dim_names or ())
        shape = tuple(world[0][1])
    except Exception:  # noqa: BLE001
        return ""
    splits = [(n, d) for n, d in zip(names, shape) if n in ("tp", "cp", "ep") and d > 1]
    if not splits:
        return ""
    inner = getattr(model, "module", model)          # DDP's wrapped module
    cfg = getattr(inner, "config", None)
    for dim_name, size in splits:
        for field, what in _SPLIT_FIELDS:
            value = getattr(cfg, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % size:
                ok = [k for k in range(1, value + 1) if value % k == 0 and k <= size * 4][:6]
                return (f"the model's {value} {what} (config.{field}) do not divide by the {dim_name} mesh "
                        f"dimension ({size}): each {dim_name} rank must hold a whole share ({value} % {size} = "
                        f"{value % size}); use a {dim_name} size that divides {value} "
                        f"({', '.join(map(str, ok))}) or a model whose {what} divide by {size}")
    dim_name, size = splits[0]
    return (f"a reshape failed on a rank of the {dim_name} mesh dimension ({size}): a head count or width "
            f"that does not divide by {size}, or a parallelize plan that leaves the modules' head counts "
            f"at the whole model's (divide them by the {dim_name} size, as torchtitan does)")


def _where(e: BaseException, path: str) -> str:
    """``file:line`` of the deepest frame in the user's model file (else the deepest user frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        return f"{os.path.relpath(e.filename)}:{e.lineno}"
    target = os.path.abspath(path)
    best = None
    for fr in tb:
        if os.path.abspath(fr.filename) == target:
            best = fr
    if best is None:
        import torch
        skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
        for fr in tb:
            if not fr.filename.startswith(skip):
                best = fr
    return f"{os.path.relpath(best.filename)}:{best.lineno}" if best else path


def _raised(e: BaseException) -> str:
    """``raised ValueError: text``, or ``called sys.exit(3)`` for a SystemExit."""
    if isinstance(e, SystemExit):
        code = e.code
        return f"called sys.exit({'' if code is None else _msg_text(repr(code))})"
    return f"raised {type(e).__name__}: {_msg(e)}"


def _msg_text(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _msg(e: BaseException) -> str:
    text = " ".join(_text(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _text(e: BaseException) -> str:
    """``str(e)``, or a note when the exception's own ``__str__`` raises."""
    try:
        return str(e)
    except USER_ERRORS as inner:
        return f"<its str() raised {type(inner).__name__}>"
