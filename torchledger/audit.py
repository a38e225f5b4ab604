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
from .spec import AuditError, _call, infer_tokens, pick_loss

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
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(allow_non_fake_inputs=True):
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
              peak_flops=None, timing_steps: int = 2, torch_logs: bool = False,
              world_size: Optional[int] = None, mesh=None) -> AuditRun:
    """Load, build, run and trace ``steps`` training steps; returns an ``AuditRun``.

    torch's own error logs of a failing fake kernel are silenced meanwhile (the failure comes
    back as one ``AuditError``) unless ``torch_logs`` is true.

    ``world_size`` and/or ``mesh`` (``"8x8"`` or a tuple) simulate that many ranks
    (:mod:`torchledger.world`): the step runs as rank 0 under a fake process group, after
    ``AuditSpec.parallelize(model, mesh)``; the process group is gone when this returns.
    """
    with quiet_torch_logs(not torch_logs), _same_cwd():
        world = _resolve_world(world_size, mesh, device)
        if world is None:
            return _run_audit(path, entry, device, steps, peak_flops, timing_steps)
        from .world import WorldError, fake_world
        try:
            with fake_world(*world) as device_mesh:
                return _run_audit(path, entry, device, steps, peak_flops, timing_steps,
                                  world=(world, device_mesh))
        except WorldError as e:
            raise AuditError(str(e)) from None


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


def _parallelize(spec, model, world, path: str):
    """``AuditSpec.parallelize(model, mesh)`` at a simulated world size; its model."""
    import torch
    (n, shape), device_mesh = world
    fn = spec.parallelize
    if fn is None:
        if n == 1:
            return model
        raise AuditError(f"{path}: --world-size {n}: the AuditSpec has no parallelize, so every rank "
                         f"would hold and step the whole model; add AuditSpec(parallelize=fn), fn(model, "
                         f"mesh) applying fully_shard/parallelize_module and returning the model (see "
                         f"examples/llama2_7b_fsdp.py)")
    try:
        out = fn(model, device_mesh)
    except USER_ERRORS as e:
        raise AuditError(f"{_where(e, path)}: AuditSpec.parallelize(model, mesh) {_raised(e)} (mesh "
                         f"{'x'.join(map(str, shape))}, dims {', '.join(device_mesh.mesh_dim_names or ())})"
                         ) from None
    if not isinstance(out, torch.nn.Module):
        raise AuditError(f"{path}: AuditSpec.parallelize(model, mesh) returned {type(out).__name__}, "
                         f"expected the nn.Module (fully_shard returns it: end with `return model`)")
    return out


def _run_audit(path, entry, device, steps, peak_flops, timing_steps, world=None) -> AuditRun:
    import torch
    from .spec import as_spec
    from .ledger import Ledger

    if steps < 1:
        raise AuditError(f"--steps: expected a whole number >= 1, got {steps}")
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
        if world is not None:
            model = _parallelize(spec, model, world, path)
        inputs = _to_device(spec.inputs, device)
        count = infer_tokens(inputs)
        tokens = spec.tokens or count.tokens
        source = TOKENS_FROM_SPEC if spec.tokens else count.source
        seq = spec.seq_len or count.seq_len
        try:
            opt = (spec.optimizer or torch.optim.AdamW)(model.parameters())
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
                raise _step_error(e, path, device) from None

        for _ in range(steps):
            try:
                with ledger.step(tokens=tokens, seq_len=seq, tokens_source=source):
                    step()
            except AuditError:
                raise
            except USER_ERRORS as e:        # entering or leaving the tracer, not the step
                raise AuditError(f"{_where(e, path)}: tracing the step {_raised(e)}; the model file "
                                 f"changes something the tracer relies on (torch's dispatch modes, "
                                 f"module or optimizer hooks): leave torch's own classes unpatched") from None
        if device in ("cpu", "cuda"):       # untraced steps time the step for MFU
            if timing_steps and any(r.meta.get("compiled") for r in ledger.records):
                step()                      # the traced steps ran eagerly: compile untimed
            for _ in range(timing_steps):
                with ledger.time_step():
                    step()
    _restore_cwd(cwd)                   # a model file that chdir'd: paths are the user's again
    from .render.sarif import spec_location
    spec_line = spec_location(path, entry)[1]        # SARIF points here; report never opens the file
    for r in ledger.records:
        r.meta["audit"] = {"file": os.path.relpath(path), "entry": entry, "device": device,
                           "steps": steps, "seq_len": seq, "spec_line": spec_line,
                           "loss": loss_source[0] if loss_source else None}
        if world is not None:        # simulated: rank 0 of n (the report says so)
            (n, shape), _ = world
            r.meta["audit"].update(world_size=n, mesh=list(shape), rank=0)
            # NB: set, not defaulted: a tracer that reads the process group finds the same
            # rank and size, but no mesh unless one is current
            r.totals.update(rank=0, world_size=n, mesh=list(shape))
            if not str(r.meta.get("device") or "").startswith("fake"):
                # NB: the tracer reads the device off the first parameter, and a sharded one is
                # a DTensor (not a FakeTensor) around its fake shard; the step was fake, so no
                # MFU is read from its time
                r.meta["device"] = "fake (cpu)"
    run = AuditRun(ledger.records, spec, device, path)
    run.snapshot = ledger.snapshot
    run.untraced_seconds = list(ledger.untraced_seconds)
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
                       untraced_steps=len(run.untraced_seconds))
    run.record.totals.update(mfu_totals(run.records, options))
    return options


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
                f"dtype=torch.bfloat16 in its constructor), or use --device cpu")
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


def _step_error(e: BaseException, path: str, device: str) -> AuditError:
    name = type(e).__name__
    if isinstance(e, SystemExit):
        return AuditError(f"{_where(e, path)}: the training step {_raised(e)}; the model, loss_fn and "
                          f"step must return (or raise), not exit")
    hint = _device_hint(e, device) or (
        "; try --device cpu (or --device meta)" if device == "fake" and "fake" in _text(e).lower()[:200] else "")
    if hint:
        return AuditError(f"{_where(e, path)}: the step cannot run on {device} tensors ({name}: "
                          f"{_msg(e)}){hint}")
    return AuditError(f"{_where(e, path)}: the training step raised {name}: {_msg(e)}; check the "
                      f"inputs your audit_spec() returns against what the model expects")


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
