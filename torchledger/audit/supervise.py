"""Run ``audit``'s work in a child process, so that the model file cannot decide the result.

A model file runs arbitrary code: it can ``os._exit(0)`` (an exit code CI reads as a pass,
with no report), hang at import, in ``audit_spec()`` or in ``forward``, or leave a thread
that keeps printing after the report. ``supervise(work, ...)`` forks: the child runs
``work()`` (load, trace, analyze, render) and sends back what it made, one JSON line (for
``audit``, through the ``supervised`` decorator: the text its ``_emit`` was given and the
exit code, or the one-line error), carrying a token the parent drew for the run (a line
without it is not the audit's: "malformed result"); the parent alone writes stdout (and
``--output``) and picks the exit code. Everything the child prints, at the Python or the file
descriptor level, reaches the parent's stderr through a pipe, and only while the child runs.

* The child ends without sending its result (``os._exit(n)``, a signal, a crash): exit 2, one
  line saying so, naming the model file's line that called ``os._exit`` (the child's
  ``os._exit`` notes its caller first) or the stack ``faulthandler`` wrote at a crash.
* The result sent, then the model file's exit handlers still running ``EXIT_GRACE_S``
  seconds later (a thread joined at exit, a server left up): they are stopped, a warning
  says so, and the result stands (its exit code too); the audit does not wait out ``timeout``.
* No result within ``timeout`` seconds: the child's stack is dumped (``faulthandler`` on
  ``SIGUSR1``, which works inside C code too), the child is killed, and one line names the
  model file's frames that were running (innermost first). Exit 2.
* An exception no one turned into an ``AuditError`` (a model file that breaks torch's own
  machinery): one line naming it and where, exit 2 (``--debug`` shows the traceback).
* What the model file starts (DataLoader workers, ``multiprocessing``, ``subprocess``, a
  daemon) ends with the child. The child leads its own session and process group, with stdin
  from ``/dev/null`` (it cannot read, or stop on, the terminal). Once it has ended, whatever
  ended it (its result sent, ``os._exit``, a crash, ``--timeout``), the parent SIGKILLs its
  group, before reaping the child: until then the group's id (the child's pid) cannot name
  another process's group. On Linux, what left the group (``setsid``, a double-fork daemon,
  ``start_new_session=True``) ends too, from any parent, threaded or not: the child is a
  child subreaper, so those stay its descendants, and it SIGKILLs its descendants
  (``end_descendants``, by ``/proc`` parentage) before it exits, after its result or at the
  model file's ``os._exit``; a child the parent must end (``--timeout``, exit handlers past
  their grace, a signal) is frozen (SIGSTOP) and its descendants ended first. Then, from a
  parent with one Python thread (the command line), the parent -- a child subreaper while the
  child runs -- kills and reaps what was orphaned to it all the same (``_Reaper``).
* Signals to the parent: Ctrl-C reaches the parent alone (the foreground group); its
  ``KeyboardInterrupt`` ends the child's group ("aborted", 130, as before). SIGTERM (``kill``,
  ``timeout``, a CI runner), SIGHUP and SIGQUIT, where their handler is the default action,
  end the child's group, then the parent as they would have. Ctrl-Z (SIGTSTP) stops the
  child's group with the parent; SIGCONT continues both, and the time stopped does not count
  towards ``--timeout``.

Cost: one ``fork()`` of the parent, which has not imported torch (the child imports it), and
one pipe read; measured by ``benchmarks/bench_audit_supervisor.py``. When the parent has
imported torch (the CLI called in-process, as tests do) the child runs torch single-threaded:
GNU OpenMP's thread pool does not survive a fork and would hang the child's first parallel op.

What the standard library already does, and why the rest is here:

* ``faulthandler`` does the stack dumps (``enable`` for a crash, ``register(SIGUSR1)`` for a
  timeout). ``faulthandler.dump_traceback_later`` would time the child from inside it, but
  ``--timeout`` does not count the time the parent was stopped (Ctrl-Z), and the parent must
  end the child's group after the dump: so the parent keeps the clock and asks for the dump.
* ``multiprocessing`` (fork context) gives a forked target and an exit code, but runs its own
  exit path in the child (``os._exit`` after the target: the model file's exit handlers never
  run, and a grace period for them cannot be given), cannot say which line called
  ``os._exit``, and reaps before anyone can kill what is left of the child's group (once
  reaped, the group's id may name another process's group). So: ``os.fork`` and ``waitid``
  with ``WNOWAIT`` (see ``_Child``).
* ``subprocess`` with ``start_new_session=True`` would make the group the same way, but
  execs a new interpreter: the audit's work is a closure over the parsed command line, run
  in a process that has not imported torch yet (``fork`` costs one copy-on-write page table;
  a new interpreter re-imports torchledger and re-parses the arguments). ``os.setsid`` in the
  forked child is the same call ``start_new_session`` makes.

``inprocess=True`` (``--debug``), or a platform without ``fork``: ``work()`` runs here, as it
did before (tracebacks, breakpoints; no timeout).

Known limitations: the supervisor guards against accidents, not malice. The model file runs
as the child, with the child's memory (the token included) and descriptors: code written to
deceive the audit can forge its result, or stop the parent (SIGSTOP). Audit model files with
the trust of ``python model.py``. A SIGKILL of the parent itself kills the child
(``PR_SET_PDEATHSIG``) but leaves what the child started running. The child's group always ends with the audit; a
process that left it is ended only on Linux, and where the child dies without ending its
descendants (a crash, a SIGKILL from elsewhere) only from a parent with one Python thread
(the CLI called in-process from a threaded program then kills the group alone); the
searches give up after ``SWEEP_S`` seconds (a fork bomb outruns them). ``posix._exit`` called
directly is not traced to its line (the message says the process ended, without a line).
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import click

from ..errors import InputError

__all__ = ["supervise", "supervised", "handed_over", "end_descendants"]

#: Seconds to wait for the child's stack after asking for it on a timeout.
STACK_WAIT_S = 2.0
#: Seconds the model file's exit handlers may run once the audit's result is in; then the
#: child is stopped and the result reported (a warning says so).
EXIT_GRACE_S = 3.0
#: Model-file frames named in a timeout or exit message (innermost first).
FRAMES_SHOWN = 4


def supervised(emit, check=None):
    """Decorator for a click command whose body runs in a child process (``audit``): takes its
    ``timeout`` option away from the body, runs the body through ``supervise`` (unless
    ``--debug``), then hands each ``(text, output)`` the body wrote (``handed_over``) to
    ``emit`` in this process and returns the body's exit code. ``check(**kwargs)``, if given,
    runs here first: arguments it refuses are reported before the child starts (and imports
    torch: seconds)."""
    import functools

    def wrap(command):
        @functools.wraps(command)
        def run(*args, timeout=None, **kwargs):
            if check is not None:
                check(**kwargs)
            if _debug():
                return command(*args, **kwargs)

            def work():
                global _HANDED
                _HANDED = []
                code = command(*args, **kwargs)
                return {"emit": _HANDED, "code": code if isinstance(code, int) else 0}
            result = supervise(work, timeout=timeout, model_path=kwargs.get("file"))
            written, code = result.get("emit"), result.get("code")
            if not (isinstance(written, list) and isinstance(code, int) and all(
                    isinstance(w, list) and len(w) == 2 and isinstance(w[0], str) for w in written)):
                raise InputError("the audit's process sent a malformed result; rerun with "
                                 "`torchledger --debug audit ...`")
            for text, output in written:
                emit(text, output)
            return code
        return run
    return wrap


#: In the child process: the ``(text, output)`` pairs the command wrote, sent to the parent.
_HANDED = None


def handed_over(text: str, output) -> bool:
    """In a supervised child: keep ``text`` (for ``output``, or stdout) for the parent to write,
    and return True. Elsewhere: False (the caller writes it)."""
    if _HANDED is None:
        return False
    _HANDED.append([text, output])
    return True


def _debug() -> bool:
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and root.params.get("debug")) or os.environ.get("TORCHLEDGER_DEBUG") == "1"


def supervise(work, *, timeout, model_path: str, inprocess: bool = False):
    """``work()`` -> a JSON-able dict, run in a child process (see the module doc); returns
    what the child sent. Raises ``InputError`` (exit 2), or the ``click.UsageError`` the child
    raised, when the child failed, ended without a result or ran past ``timeout`` seconds
    (None or 0: no limit)."""
    if inprocess or not hasattr(os, "fork"):
        return work()
    import tempfile
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        _flush(stream)
    import secrets
    token = secrets.token_hex(16)                   # this run's: on every line the child sends
    result_r, result_w = os.pipe()
    output_r, output_w = os.pipe()
    stack = tempfile.TemporaryFile()
    torch_here = "torch" in sys.modules
    if torch_here:
        _warm()
    parent = os.getpid()
    reaper = _Reaper()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns
        os.close(result_r)
        os.close(output_r)
        _child(work, _ResultPipe(result_w, token), output_w, stack, parent, torch_here, model_path)
    child = _Child(pid)
    os.close(result_w)
    os.close(output_w)
    with _Forwarded(child):
        try:
            return _wait(child, (result_r, token), output_r, stack, timeout, model_path)
        finally:
            with _deferred():
                child.end()                         # its group too,
                reaper.finish(child.start)          # then what left the group
            for fd in (result_r, output_r):
                _close(fd)
            stack.close()


# -- the child ---------------------------------------------------------------------------------
class _ResultPipe:
    """The child's end of the result pipe. Each line it sends carries the run's token, which the
    parent made before the fork: a line without it (a model file, or a process it started, that
    wrote to this descriptor by accident) is not the audit's. Only the child itself sends: a
    copy of it that the model file forked (``os.fork()`` in ``audit_spec``) and that runs on
    through the audit does not."""

    def __init__(self, fd: int, token: str):
        self.fd, self.token, self.pid = fd, token, os.getpid()

    def send(self, message: dict) -> None:
        if os.getpid() == self.pid:
            _send(self.fd, {**message, "token": self.token})

    def close(self) -> None:
        _close(self.fd)


def _child(work, result_w, output_w, stack, parent: int, torch_here: bool, model_path: str):
    exit_now = os._exit
    try:
        _child_setup(result_w, output_w, stack, parent, torch_here, exit_now)
        try:
            message = {"result": work()}
        except click.ClickException as e:
            usage = isinstance(e, click.UsageError) and not isinstance(e, InputError)
            message = {"error": _one_line(e.format_message()), "usage": usage}
        except BaseException as e:  # noqa: BLE001 (whatever the model file raised: one line)
            message = {"error": unexpected(e, model_path)}
        try:
            result_w.send(message)
        except (TypeError, ValueError) as e:        # not JSON: a bug of ours, said as one
            result_w.send({"error": f"the audit's result could not be sent ({type(e).__name__}: "
                                    f"{safe_str(e)}); rerun with `torchledger --debug audit ...`"})
        result_w.close()
        import atexit
        atexit._run_exitfuncs()             # the model file's own exit handlers, as a plain run
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
    except BaseException:  # noqa: BLE001 (nothing may escape a forked child)
        pass
    finally:
        try:
            if os.getpid() == result_w.pid:     # the child, not a copy the model file forked
                end_descendants(result_w.pid)
        except BaseException:  # noqa: BLE001 (a handler of the model file's raising: exit all the same)
            pass
        exit_now(0)


def _child_setup(result_w, output_w, stack, parent, torch_here, exit_now) -> None:
    import atexit
    import faulthandler
    import io
    _own_session()                           # first: what it starts is in its group
    _adopt_orphans()                         # and what leaves the group stays its descendant
    atexit._clear()                          # the parent's handlers are the parent's
    _die_with_parent(parent, exit_now)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C: the parent stops, then kills us
    os.dup2(output_w, 1)                     # fd 1 too: nothing of the child reaches stdout
    os.dup2(output_w, 2)
    os.close(output_w)
    out = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                           errors="backslashreplace", line_buffering=True)
    sys.stdout = sys.stderr = out
    faulthandler.enable(file=stack, all_threads=True)           # a crash: where
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True, chain=False)  # a timeout
    me = os.getpid()

    def _exit(status):
        """``os._exit`` that first tells the parent which line called it."""
        if os.getpid() == me:
            try:
                import traceback
                frames = traceback.extract_stack(sys._getframe(1), limit=64)
                result_w.send({"exit": status, "stack": [[f.filename, f.lineno, f.name] for f in frames]})
                end_descendants(me)
            except BaseException:  # noqa: BLE001 (exit all the same)
                pass
        exit_now(status)
    os._exit = _exit
    if torch_here:
        import torch
        torch.set_num_threads(1)            # see the module doc: OpenMP after fork


def _warm() -> None:
    """With torch already imported here (the CLI called in-process): import what an audit
    imports, once, here, so that each child does not import it again (seconds: sympy, fake
    tensors). Imports only: no torch op runs in this process."""
    import importlib
    for name in WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


#: Modules every audit imports (``_warm``).
WARM = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
        "torch.distributed", "torchledger.audit", "torchledger.audit.engine", "torchledger.audit.pipeline",
        "torchledger.ledger", "torchledger.tracer",
        "torchledger.tracer.step", "torchledger.analyzers.checks", "torchledger.render",
        "torchledger.render.sarif", "torchledger.lint", "torchledger.settings", "torchledger.tracer.retention",
        "torchledger.tracer.segments", "torchledger.tracer.shape", "torchledger.tracer.dist_record",
        "torchledger.tracer.cuda_history")


def _own_session() -> None:
    """The child leads a new session (its process group's id is its pid), with no controlling
    terminal and stdin from ``/dev/null``: it cannot read or stop on the terminal, a Ctrl-C
    reaches only the parent (which ends the child's group), and the parent can end the
    group whatever its members did with their signals."""
    try:
        os.setsid()
    except OSError:                         # not expected after fork(); the group kill misses
        pass
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    except OSError:
        pass


def _adopt_orphans() -> None:
    """Linux: the child is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process the model
    file starts that leaves its group and loses its parent (``setsid``, a double-fork daemon)
    becomes the child's child, not init's, so ``end_descendants`` finds it. Unlike the
    parent's ``_Reaper`` this needs no one-thread process: every descendant of the child is
    the model file's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def end_descendants(root: int, within: float = None) -> int:
    """SIGKILL every living descendant of ``root`` (by ``/proc`` parentage, whatever their group
    or session), again until none is left or ``within`` seconds (``SWEEP_S``) have passed (they
    may be forking). Linux; elsewhere nothing. How many were signalled."""
    if not sys.platform.startswith("linux"):
        return 0
    if root == os.getpid():                 # ending: a SIGCHLD handler (DataLoader's raises when
        try:                                # a worker dies) must not interrupt it
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except (ValueError, OSError):       # not the main thread
            pass
    end = time.monotonic() + (SWEEP_S if within is None else within)
    killed = 0
    while True:
        found = _descendants(root)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if not found or time.monotonic() >= end:
            return killed
        time.sleep(0.001)


def _descendants(root: int) -> list:
    """The living (not zombie) descendants of ``root``, from one read of ``/proc``."""
    by_parent = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            st = _stat(name)
            if st:
                by_parent.setdefault(st["ppid"], []).append((int(name), st["state"]))
    out, todo = [], [root]
    while todo:
        for pid, state in by_parent.get(todo.pop(), ()):
            todo.append(pid)            # a zombie's children were reparented: none to follow
            if state not in "ZX":
                out.append(pid)
    return out


def _die_with_parent(parent: int, exit_now) -> None:
    """Linux: the child is killed when the parent dies (a CI job cancelled)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:              # it died before prctl took effect
        exit_now(2)


def _send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def unexpected(e: BaseException, model_path) -> str:
    """One line for an exception nothing turned into an ``AuditError``: its type, its message
    (even when ``str()`` raises) and the deepest frame of the model file (else the deepest)."""
    import traceback
    target = os.path.abspath(model_path) if model_path else None
    where = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == target]
    at = f"{_short(where[-1].filename)}:{where[-1].lineno}: " if where else ""
    return _one_line(f"{at}the audit stopped: {type(e).__name__}: {safe_str(e)}; rerun with "
                     f"`torchledger --debug audit ...` for the traceback")


def safe_str(e: BaseException) -> str:
    """``str(e)``, or what went wrong making it (an exception whose ``__str__`` raises)."""
    try:
        text = str(e)
    except BaseException as inner:  # noqa: BLE001
        return f"<its str() raised {type(inner).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


# -- the parent --------------------------------------------------------------------------------
def _wait(child, result, output_r, stack, timeout, model_path):
    """Forward the child's output, read its result pipe ``(fd, token)``, until it has ended;
    the result its lines carry (with the token), or ``InputError``."""
    (result_r, token), result = result, None
    deadline = time.monotonic() + timeout if timeout else None
    pidfd = _pidfd(child.pid)
    for fd in (result_r, output_r):
        os.set_blocking(fd, False)
    lines, pending, status, ended, graced = [], bytearray(), None, set(), False
    sink = _Forward()
    try:
        while status is None:
            if result is not None and not graced:       # the report is in: a short grace
                deadline, graced = _grace(deadline, child.paused), True
            left = None if deadline is None else deadline + child.paused - time.monotonic()
            if left is not None and left <= 0:
                if result is not None:       # sent, then stuck in its exit handlers
                    child.end()
                    click.echo(f"torchledger: warning: the model file's exit handlers were still running "
                               f"{EXIT_GRACE_S:g} s after the audit's result was in; stopped them", err=True)
                    return _outcome(result, _forged(lines, token))
                raise InputError(_timed_out(child, stack, timeout, model_path))
            watch = [fd for fd in (result_r, output_r, pidfd) if fd is not None and fd not in ended]
            wait = left if pidfd is not None else min(left if left is not None else 0.02, 0.02)
            ready, _, _ = select.select(watch, [], [], wait)
            for fd in ready:
                if fd in (output_r, result_r):
                    data = _read(fd)
                    if data is None:            # end of file: the child (and its children) closed it
                        ended.add(fd)
                    elif fd == output_r:
                        sink.write(data)
                    else:
                        pending += data
            if pidfd in ready or pidfd is None:
                status = child.ended()
            while b"\n" in pending:
                line, _, rest = bytes(pending).partition(b"\n")
                pending = bytearray(rest)
                lines.append(line)
                message = _decode(line, token)
                if message is not None and "exit" not in message and result is None:
                    result = message
        pending += _drain(result_r)
        sink.write(_drain(output_r))
        lines += [line for line in bytes(pending).split(b"\n") if line]
    except BaseException:
        child.end()
        raise
    finally:
        sink.flush()
        if pidfd is not None:
            _close(pidfd)
    messages = [m for m in (_decode(line, token) for line in lines) if m is not None]
    result = next((m for m in messages if "exit" not in m), None)
    forged = _forged(lines, token)
    if result is not None:
        return _outcome(result, forged)
    if forged:
        raise InputError(f"the audit's process sent a malformed result: {forged} line(s) on its result pipe "
                         f"without this run's token (the model file, or a process it started, wrote to "
                         f"the audit's descriptor); there is no report. Rerun with `torchledger --debug "
                         f"audit ...` to see it in this process")
    exit_note = next((m for m in messages if "exit" in m), None)
    raise InputError(_ended(status, exit_note, _read_stack(stack), model_path))


def _grace(deadline, paused: float) -> float:
    """The deadline once the audit's result is in: at most :data:`EXIT_GRACE_S` from now for
    the model file's exit handlers (``atexit``), not what is left of ``--timeout``. Like
    ``deadline``, it is reached when ``deadline + paused`` (the time stopped) is."""
    grace = time.monotonic() + EXIT_GRACE_S - paused
    return grace if deadline is None else min(deadline, grace)


def _forged(lines, token: str) -> int:
    """How many of the result pipe's lines did not carry this run's token."""
    return sum(1 for line in lines if line.strip() and _decode(line, token) is None)


def _outcome(message: dict, forged: int = 0):
    if forged:
        click.echo(f"torchledger: warning: {forged} line(s) on the audit's result pipe did not carry this "
                   f"run's token (something other than the audit wrote to it); ignored", err=True)
    if "error" in message:
        if message.get("usage"):
            raise click.UsageError(str(message["error"]), ctx=click.get_current_context(silent=True))
        raise InputError(str(message["error"]))
    result = message.get("result")
    if not isinstance(result, dict):
        raise InputError("the audit's process sent a malformed result; rerun with `torchledger --debug audit ...`")
    return result


def _timed_out(child, stack, timeout, model_path) -> str:
    """Ask the child for its stack (faulthandler, SIGUSR1), kill it, say where it was."""
    size = _size(stack)
    try:
        os.kill(child.pid, signal.SIGUSR1)
    except ProcessLookupError:
        pass
    end = time.monotonic() + STACK_WAIT_S
    last = -1
    while time.monotonic() < end:
        time.sleep(0.02)
        now = _size(stack)
        if now > size and now == last:     # written, and not growing
            break
        last = now
    child.end()
    frames = _main_thread(_read_stack(stack, since=size))
    where = _frames_text(frames, model_path)
    at = f"; it was running {where}" if where else " (its stack could not be read)"
    return (f"the audit did not finish within {timeout:g} s (--timeout){at}; stopped. Fix the loop or "
            f"wait, or raise --timeout (0: no limit)")


def _ended(status, exit_note, crash_stack, model_path) -> str:
    how = _status_text(status)
    if exit_note is not None:
        frames = [_Frame(*f) for f in exit_note.get("stack") or [] if len(f) == 3]
        mine = _pick(frames, model_path)
        at = f"{_short(mine[0].filename)}:{mine[0].lineno}: " if mine else ""
        return (f"{at}the model file ended the audit's process with os._exit({exit_note.get('exit')}) "
                f"before the audit finished; there is no report. Remove the exit (or put it under "
                f"`if __name__ == \"__main__\":`)")
    frames = _main_thread(crash_stack)
    where = _frames_text(frames, model_path)
    at = f", while running {where}" if where else ""
    return (f"the audit's process ended ({how}) before the audit finished{at}: the model file (or code "
            f"it called) ended the process; there is no report. Rerun with `torchledger --debug audit "
            f"...` to see it in this process")


def _status_text(status) -> str:
    if status is None:
        return "status unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by signal {name}"
    return f"exit status {os.WEXITSTATUS(status)}"


# -- the child's group, and what left it -----------------------------------------------------------
class _Child:
    """The forked child, which leads its own session and process group (same id as its pid).

    The group is signalled only while the child is unreaped (running, or a zombie): until the
    ``waitpid`` that reaps it, its pid -- hence the group's id -- cannot name another process
    or group. So an exit is seen without reaping (``waitid(WNOWAIT)``), what is left of the
    group is killed, and only then is the child reaped."""

    def __init__(self, pid: int):
        self.pid = pid
        self.status = None          # its wait status, once reaped
        self.paused = 0.0           # seconds this process was stopped (Ctrl-Z): not --timeout's
        self.start = _stat(pid).get("start")

    def ended(self):
        """None while the child runs; once it has exited: end its group, reap it, return the
        status."""
        if self.status is not None:
            return self.status
        if hasattr(os, "waitid"):
            try:
                seen = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:       # reaped elsewhere: its pid is no longer its own
                self.status = 0
                return 0
            return None if seen is None else self.end()
        try:                        # no waitid: reaped as it is seen, the group is left be
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done, status = self.pid, 0
        if done:
            self.status = status
        return self.status

    def end(self) -> int:
        """SIGKILL to the child's group and to the child (idle on a zombie), then reap it.
        Once; its wait status."""
        if self.status is None:
            if self.unreaped() and _stat(self.pid).get("state", "Z") not in "ZX":
                try:                        # alive: frozen, so that it starts no more, and what it
                    os.kill(self.pid, signal.SIGSTOP)   # started (any group) ended while it is
                except ProcessLookupError:              # their ancestor
                    pass
                end_descendants(self.pid)
            for kill in (os.killpg, os.kill) if self.unreaped() else ():
                try:                        # killpg: ESRCH if it had not made its group yet
                    kill(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                status = 0
            self.status = status
        return self.status

    def unreaped(self) -> bool:
        """The child is running or a zombie (not reaped, by us or by anyone else in this
        process): its pid, and its group's id, are still its own to signal."""
        if self.status is not None:
            return False
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        except AttributeError:              # no waitid here: as before, trust the pid
            pass
        return True


class _Stop(BaseException):
    """A signal of ``ENDING`` whose handler was the default action arrived while a child ran."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: Signals whose default action ends this process: with it they end the child's group first.
ENDING = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT")


class _Forwarded:
    """While the child runs: a signal that would end this process (SIGTERM from ``timeout`` or
    a CI runner, SIGHUP from a closed terminal; SIGINT where its handler is the default
    action; Python's own SIGINT handler raises ``KeyboardInterrupt``, which ends the child
    the same way) first ends the child's group, then ends this process as it would have.
    Ctrl-Z (SIGTSTP) stops the child's group with this process and continues it with it.
    Only handlers left at the default action are replaced, and only in the main thread."""

    def __init__(self, child: _Child):
        self.child = child
        self.saved = {}

    def __enter__(self):
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in ENDING + ("SIGTSTP",):
            sig = getattr(signal, name, None)
            if sig is None or signal.getsignal(sig) is not signal.SIG_DFL:
                continue
            self.saved[sig] = signal.signal(sig, self._pause if name == "SIGTSTP" else self._stop)
        return self

    def __exit__(self, kind, exc, tb):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if isinstance(exc, _Stop):              # the child's group is gone: end as the signal would
            for stream in (sys.stdout, sys.stderr):
                _flush(stream)
            os.kill(os.getpid(), exc.signum)
            raise SystemExit(128 + exc.signum)  # reached only were the signal blocked
        return False

    @staticmethod
    def _stop(signum, frame):
        raise _Stop(signum)

    def _pause(self, signum, frame):
        began = time.monotonic()
        self._group(signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)    # stopped here until SIGCONT (fg, bg)
        signal.signal(signal.SIGTSTP, self._pause)
        self._group(signal.SIGCONT)
        self.child.paused += time.monotonic() - began

    def _group(self, sig) -> None:
        if self.child.unreaped():               # the group is still the child's
            try:
                os.killpg(self.child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


class _deferred:
    """Signals that would interrupt (Ctrl-C, those of ``ENDING``) wait until the block is done,
    then are delivered: the child's group is killed and reaped whole. Main thread only (Python
    runs signal handlers there alone)."""

    def __enter__(self):
        import threading
        self.saved, self.got = {}, []
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in ENDING + ("SIGTSTP",):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is not None:   # None: set outside Python
                self.saved[sig] = signal.signal(sig, lambda n, f: self.got.append(n))
        return self

    def __exit__(self, kind, exc, tb):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        for sig in self.got:
            os.kill(os.getpid(), sig)
        return False


#: Seconds ``_Reaper.finish`` spends at most killing and reaping what left the child's group.
SWEEP_S = 2.0


class _Reaper:
    """Linux: this process is a child subreaper (``PR_SET_CHILD_SUBREAPER``) while the child
    runs, so a process the model file started that left the child's group (``setsid``, a
    double-fork daemon, ``start_new_session=True``) and lost its parent becomes this process's
    child instead of init's; ``finish`` kills and reaps those. Only when this process has
    one Python thread (no one else here starts processes meanwhile), and only processes in
    another session than this one (the audit's child made its own: nothing it starts can
    join this one), started no earlier than the child, that were not this process's
    children before."""

    def __init__(self):
        self.on = self.set = False
        if not sys.platform.startswith("linux"):
            return
        import threading
        if threading.active_count() != 1:
            return
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            flag = ctypes.c_int(0)
            if libc.prctl(37, ctypes.byref(flag), 0, 0, 0) != 0:     # PR_GET_CHILD_SUBREAPER
                return
            if not flag.value:
                if libc.prctl(36, 1, 0, 0, 0) != 0:                  # PR_SET_CHILD_SUBREAPER
                    return
                self.set = True
        except (OSError, AttributeError):
            return
        self._libc = libc
        self.me, self.session = os.getpid(), os.getsid(0)
        self.before = {pid for pid, _ in _children(self.me)}
        self.on = True

    def finish(self, since) -> None:
        """Kill and reap what left the child's group (and what those started), then stop
        being a subreaper."""
        if not self.on:
            return
        self.on = False
        try:
            end = time.monotonic() + SWEEP_S
            while since is not None and time.monotonic() < end:
                found = [pid for pid, st in _children(self.me) if pid not in self.before and
                         st.get("session") != self.session and st.get("start", -1) >= since]
                if not found:
                    break
                for pid in found:           # our unreaped children: these pids are theirs
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                for pid in found:
                    while time.monotonic() < end:
                        try:
                            if os.waitpid(pid, os.WNOHANG)[0]:
                                break
                        except ChildProcessError:
                            break
                        time.sleep(0.001)
        finally:
            if self.set:
                self._libc.prctl(36, 0, 0, 0, 0)


def _stat(pid) -> dict:
    """Fields of ``/proc/PID/stat``: ppid, session, start (clock ticks after boot); {} when
    unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()
        return {"state": rest[0].decode(), "ppid": int(rest[1]), "session": int(rest[3]), "start": int(rest[19])}
    except (OSError, ValueError, IndexError):
        return {}


def _children(ppid: int) -> list:
    """``(pid, _stat(pid))`` of the processes whose parent is ``ppid``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if name.isdigit():
            st = _stat(name)
            if st.get("ppid") == ppid:
                found.append((int(name), st))
    return found


# -- stacks --------------------------------------------------------------------------------------
class _Frame:
    __slots__ = ("filename", "lineno", "name")

    def __init__(self, filename, lineno, name):
        self.filename, self.lineno, self.name = str(filename), int(lineno), str(name)


def _read_stack(stack, since: int = 0) -> str:
    try:
        stack.seek(since)
        return stack.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


def _main_thread(text: str) -> list:
    """The frames of the child's main thread, outermost first, from a faulthandler dump (the
    block that holds this module's own frame: the child's ``_child``)."""
    import re
    blocks, current = [], None
    for line in text.splitlines():
        if "(most recent call first)" in line:
            current = []
            blocks.append(current)
            continue
        m = re.match(r'\s+File "(.*)", line (\d+) in (.*)$', line)
        if m and current is not None:
            current.append(_Frame(m.group(1), m.group(2), m.group(3)))
    if not blocks:
        return []
    mine = os.path.abspath(__file__)
    main = next((b for b in blocks if any(os.path.abspath(f.filename) == mine for f in b)), blocks[0])
    return list(reversed(main))


def _pick(frames, model_path) -> list:
    """Frames of the model file, innermost first; else the innermost frame outside
    torchledger and torch; else the innermost."""
    frames = list(frames)
    if model_path:
        target = os.path.abspath(model_path)
        mine = [f for f in reversed(frames) if os.path.abspath(f.filename) == target]
        if mine:
            return mine
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = (here + os.sep, os.sep + "torch" + os.sep, "<frozen")
    rest = [f for f in reversed(frames) if not any(s in os.path.abspath(f.filename) or
                                                    f.filename.startswith(s) for s in skip)]
    return rest or list(reversed(frames))[:1]


def _frames_text(frames, model_path) -> str:
    picked = _pick(frames, model_path)[:FRAMES_SHOWN]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in picked)


def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith(".." + os.sep + "..") else rel


# -- plumbing ------------------------------------------------------------------------------------
class _Forward:
    """Bytes from the child's output pipe, written to this process's stderr as they come."""

    def __init__(self):
        import codecs
        self._decode = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> None:
        if not data:
            return
        err = sys.stderr
        buffer = getattr(err, "buffer", None)
        try:
            if buffer is not None:
                err.flush()
                buffer.write(data)
                buffer.flush()
            else:
                err.write(self._decode.decode(data))
                err.flush()
        except (OSError, ValueError):       # a closed stderr: the child's noise is dropped
            pass

    def flush(self) -> None:
        _flush(sys.stderr)


def _decode(line: bytes, token: str):
    """The child's message on ``line``: a JSON object that carries ``token``; else None."""
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(message, dict) or message.pop("token", None) != token:
        return None
    return message


def _read(fd: int):
    """Bytes from a non-blocking pipe: ``b""`` when none now, None at its end."""
    try:
        return os.read(fd, 1 << 16) or None
    except (BlockingIOError, InterruptedError):
        return b""
    except OSError:
        return None


def _drain(fd: int) -> bytes:
    """What is left in a pipe now (grandchildren may keep it open: no waiting for EOF)."""
    out = bytearray()
    while True:
        chunk = _read(fd)
        if not chunk:
            return bytes(out)
        out += chunk


def _pidfd(pid: int):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _size(f) -> int:
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, ValueError):
        return 0


def _flush(stream) -> None:
    try:
        if stream is not None:
            stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _close(fd) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
