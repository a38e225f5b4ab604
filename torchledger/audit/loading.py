"""Loading a model file and the context its code runs in: the module import (``load_entry``),
the device (``device_context``: a FakeTensorMode, meta, CPU or CUDA), stdout kept for the
report (``stdout_to_stderr``), torch's own error logs kept quiet, and fake-tensor-safe
initialisers. Shared by the single-process engine and the pipeline stage runner."""
from __future__ import annotations

import contextlib
import os
import sys
import types

from .errors import USER_ERRORS, raised, where
from .spec import AuditError

__all__ = ["AuditRun", "DEVICES", "stdout_to_stderr", "load_entry", "device_context", "to_device",
           "TORCH_LOGGERS", "quiet_torch_logs", "fake_safe_init"]

DEVICES = ("fake", "meta", "cpu", "cuda")


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
        raise AuditError(f"{where(e, path)}: importing the model file {raised(e)}") from None
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
        from ..tracer.fake import fake_mode     # a deep-copied layer keeps the mode (and its weights)
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


def to_device(x, device: str):
    import torch
    if device not in ("meta", "cuda"):
        return x
    target = torch.device(device)
    if isinstance(x, torch.Tensor):
        return x.to(target) if x.device.type != device else x
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
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


@contextlib.contextmanager
def fake_safe_init(device: str):
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
