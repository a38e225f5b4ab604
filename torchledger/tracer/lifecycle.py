"""Installing and removing a tracer as one unit that Ctrl-C and threads cannot split.

``Installed`` is what one ``StepTracer`` put in place: a list of *idempotent* undo actions
(each checks before it acts, so running it twice, or before the thing it undoes was done,
is harmless), undone last-first by ``close``. Each undo is registered before the thing it
undoes, or right after it with no Python-level call in between (a hook's handle:
``life.undo.append(register(hook).remove)``, where ``append`` is C), so an exception raised
at any function entry (where Python delivers a KeyboardInterrupt) leaves nothing that
``close`` does not know about. The caller re-runs ``close`` until it returns: an undo that was
interrupted stays on the list and runs again.

On the main thread SIGINT is deferred while a tracer is entered or left: the handler only
notes the signal, and ``resume`` hands it to the handler that was there before (normally
raising ``KeyboardInterrupt``) once everything is in place or gone. A process-wide lock makes
"one tracer at a time" hold between threads.

Known limitations: a Ctrl-C at the very entry of ``StepTracer.__exit__`` (before its first
line) is beyond the tracer's reach: Python then never runs its body.
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
    for i in range(_stack_len()):        # NB: no generator here (see close)
        if _stack_at(i) is mode:
            return True
    return False


class Installed:
    """Idempotent undo actions for everything one tracer installed (see the module doc)."""

    def __init__(self):
        self.undo: list = []
        self.locked = False
        self._pending: list = []        # frames of SIGINTs noted while deferred
        self._handler = None            # the SIGINT handler we replaced (None: not deferred)

    # -- SIGINT ------------------------------------------------------------------------------
    def defer_sigint(self) -> None:
        """Main thread only: note SIGINT instead of acting on it until ``resume``."""
        if self._handler is None and get_ident() == _MAIN:
            self._handler = _signal.signal(signal.SIGINT, self._note)

    def _note(self, signum, frame) -> None:
        self._pending.append(frame)

    def resume(self) -> None:
        """Put the SIGINT handler back; a signal noted meanwhile goes to it now (the default
        handler raises KeyboardInterrupt)."""
        old, self._handler = self._handler, None
        if old is None:
            return
        _signal.signal(signal.SIGINT, old)
        if self._pending:
            frame = self._pending[-1]
            self._pending.clear()
            if callable(old):
                old(signal.SIGINT, frame)

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

    def dispatch_mode(self, mode) -> None:
        """Enter ``mode`` (last: nothing of ours then runs under it)."""
        flags = {k: getattr(_pd, k) for k in _FLAGS}
        self.undo.append(lambda: _pop_mode(mode, flags))
        mode.__enter__()

    # -- remove ------------------------------------------------------------------------------
    def close(self) -> list:
        """Undo everything (last first), release the lock, resume SIGINT. A KeyboardInterrupt
        propagates with the interrupted undo still listed: call ``close`` again. Returns the
        messages of undo actions that failed otherwise (for record.warnings)."""
        self.defer_sigint()
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
        self.resume()
        return errors


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
    _pd.set_is_in_mode_without_ignore_compile_internals(
        flags["_is_in_any_mode_without_ignore_compile_internals"])
