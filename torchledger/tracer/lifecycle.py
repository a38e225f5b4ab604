"""Installing and removing a tracer as one unit that Ctrl-C and threads cannot split.

``Installed`` is what one ``StepTracer`` put in place: a list of *idempotent* undo actions
(each checks before it acts, so running it twice, or before the thing it undoes was done,
is harmless), undone last-first by ``close``. Each undo is registered before the thing it
undoes, or right after it with no Python-level call in between (a hook's handle:
``life.undo.append(register(hook).remove)``, where ``append`` is C), so an exception raised
at any function entry (where Python delivers a KeyboardInterrupt) leaves nothing that
``close`` does not know about. The caller re-runs ``close`` until it returns: an undo that was
interrupted stays on the list and runs again.

On the main thread a SIGINT handler is in place from entering until removal: a signal that
lands while the tracer's own ``__enter__``/``__exit__`` is running (the very entry of
``__exit__`` included, where a raised KeyboardInterrupt would skip its whole body) is noted
and handed to the previous handler (normally: raise ``KeyboardInterrupt``) once everything
is in place or gone; during the user's step it goes to the previous handler at once. A
process-wide lock makes "one tracer at a time" hold between threads.
"""
from __future__ import annotations

import _signal
import signal
import threading
from _thread import get_ident

import torch
from torch.utils import _python_dispatch as _pd

__all__ = ["Installed", "LOCK", "ACTIVE", "TRIES", "in_tls"]

LOCK = threading.Lock()        # held while a tracer is active (process-wide)
ACTIVE: list = []              # the active tracer, for active_tracer()
TRIES = 100                    # close() re-runs before giving up (one interrupt per run)
_MAIN = threading.main_thread().ident
_FLAGS = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
          "_is_in_any_mode_without_ignore_compile_internals")
_stack_len, _stack_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at


def in_tls(mode) -> bool:
    """``mode`` is on this thread's dispatch stack: the tracing thread, or an autograd engine
    thread running its backward (the engine hands the caller's thread-local state on)."""
    # NB: a loop, not any(genexpr): a generator abandoned early is closed later, and an
    # interrupt landing in that close is swallowed by the interpreter
    for i in range(_stack_len()):
        if _stack_at(i) is mode:
            return True
    return False


class Installed:
    """Idempotent undo actions for everything one tracer installed (see the module doc)."""

    def __init__(self):
        self.undo: list = []
        self.locked = False
        self._pending: list = []        # frames of SIGINTs noted while deferred
        self._handler = None            # the SIGINT handler we replaced (None: not ours now)
        self._previous = None           # ... once put back by close()
        self._critical: set = set()

    # -- SIGINT ------------------------------------------------------------------------------
    def watch_sigint(self, critical: set) -> None:
        """Main thread only, from entering the tracer until it is removed: a SIGINT that
        lands while a frame running one of the ``critical`` code objects is on the stack is
        noted and delivered by ``deliver``; anywhere else (the user's step) it goes to the
        previous handler at once."""
        if self._handler is None and get_ident() == _MAIN:
            self._critical = critical
            self._handler = _signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        f = frame
        while f is not None:
            if f.f_code in self._critical:
                self._pending.append(frame)
                return
            f = f.f_back
        _call(self._handler, frame)

    def deliver(self) -> None:
        """Hand a SIGINT noted meanwhile to the previous handler (normally: raise
        KeyboardInterrupt)."""
        if self._pending:
            frame = self._pending[-1]
            self._pending.clear()
            _call(self._handler, frame)

    # -- install -----------------------------------------------------------------------------
    def lock(self, owner) -> None:
        if not LOCK.acquire(blocking=False):
            raise RuntimeError("a torchledger trace is already active; exit it before entering "
                               "another (use one Ledger for many steps)")
        self.locked = True
        ACTIVE.append(owner)

    def saved_tensors_hooks(self, pack, unpack) -> None:
        self.undo.append(lambda: _pop_saved_hooks(pack))
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)

    def patch(self, obj, name: str, new) -> None:
        """``setattr(obj, name, new)``, undone only while ``new`` is still the one there."""
        old = getattr(obj, name)
        self.undo.append(lambda: getattr(obj, name) is new and setattr(obj, name, old))
        setattr(obj, name, new)

    def patch_instance(self, obj, name: str, new) -> None:
        """Set ``name`` on ``obj`` itself (over its class's attribute), undone only while ``new``
        is still the one there: the attribute it had of its own goes back, else it is deleted."""
        own = vars(obj)
        had, old = name in own, own.get(name)

        def undo():
            if vars(obj).get(name) is new:
                if had:
                    setattr(obj, name, old)
                else:
                    delattr(obj, name)
        self.undo.append(undo)
        setattr(obj, name, new)

    def dispatch_mode(self, mode) -> None:
        """Enter ``mode`` (last: nothing of ours then runs under it)."""
        flags = {k: getattr(_pd, k) for k in _FLAGS if hasattr(_pd, k)}   # torch-version private
        self.undo.append(lambda: _pop_mode(mode, flags))
        mode.__enter__()

    # -- remove ------------------------------------------------------------------------------
    def close(self) -> list:
        """Undo everything (last first), release the lock, put the SIGINT handler back and
        deliver a SIGINT noted meanwhile. A KeyboardInterrupt propagates with the interrupted
        undo still listed: call ``close`` again. Returns the messages of undo actions that
        failed otherwise (for record.warnings)."""
        errors = []
        while self.undo:
            try:
                self.undo[-1]()
            except KeyboardInterrupt:
                raise
            except Exception as e:              # a retry would fail the same way
                errors.append(f"removing a hook failed: {type(e).__name__}: {e}")
            self.undo.pop()
        if self.locked:
            self.locked = False
            ACTIVE.clear()
            LOCK.release()
        if self._handler is not None:
            if _signal.getsignal(signal.SIGINT) == self._on_sigint:   # unless the step replaced it
                _signal.signal(signal.SIGINT, self._handler)
            self._previous, self._handler = self._handler, None
        if self._pending:
            frame = self._pending[-1]
            self._pending.clear()
            _call(self._previous, frame)
        return errors


def _call(handler, frame) -> None:
    """What Python would have done with a SIGINT under ``handler``."""
    if callable(handler):
        handler(signal.SIGINT, frame)           # default_int_handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        _signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)


def _pop_saved_hooks(pack) -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and top[0] is pack:
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _pop_mode(mode, flags: dict) -> None:
    """Take ``mode`` off this thread's dispatch stack if it is there (modes the step pushed
    above it and left go back on), and restore the flags ``TorchDispatchMode.__enter__`` set."""
    if in_tls(mode):
        above = []
        while True:
            top = torch._C._pop_torch_dispatch_stack(None)
            if top is mode:
                break
            above.append(top)
        for m in reversed(above):
            torch._C._push_on_torch_dispatch_stack(m)
    for k, v in flags.items():
        setattr(_pd, k, v)
    ignore = flags.get("_is_in_any_mode_without_ignore_compile_internals")
    if ignore is not None and hasattr(_pd, "set_is_in_mode_without_ignore_compile_internals"):
        _pd.set_is_in_mode_without_ignore_compile_internals(ignore)
