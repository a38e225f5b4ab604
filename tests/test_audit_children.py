"""What a model file starts ends with its audit (cli/supervise.py): the audit's child leads its
own session and process group; when it ends (result sent, ``os._exit``, a kill, ``--timeout``,
a Ctrl-C or SIGTERM to ``torchledger``) the parent kills that group, then, as a child
subreaper, what left the group (``setsid`` daemons).

Every model file here starts the same six processes and notes each one's pid and start time:
two DataLoader workers (``persistent_workers=True``, at import), a ``multiprocessing.Process``
sleeping 300 s, ``sleep 300`` twice (``subprocess.Popen``, once with ``start_new_session=True``)
and a double-fork ``setsid`` daemon sleeping 300 s. After the command returns, none may be
alive (a zombie counts as dead) within ``GONE_S``. Whatever a test finds alive it kills.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_audit_cli import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

#: Seconds after the command returned within which the model file's processes must be gone.
GONE_S = 3.0

#: Defines ``start_all()``; ``{pids}`` is the file the pids go to. Six processes.
PRELUDE = """
import os, subprocess, sys, time, multiprocessing
import torch, torchledger
PIDS = {pids!r}
def note(pid):
    with open(f"/proc/{{pid}}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    with open(PIDS, "a") as f:
        f.write(f"{{pid}} {{start}}\\n")
def start_workers():
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    for w in it._workers:
        note(w.pid)
    return it
def start_daemon():
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.waitpid(first, 0)
    os.close(w)
    note(int(os.read(r, 64)))
def start_all():
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
    p.start()
    note(p.pid)
    note(subprocess.Popen(["sleep", "300"]).pid)
    note(subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
    start_daemon()
WORKERS = start_workers()
"""

#: name -> (the rest of the model file, extra CLI args).
CASES = {
    "a clean audit": ("""
        def audit_spec():
            start_all()
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """, ["--format", "json"]),
    "a hung forward at --timeout": ("""
        class M(torch.nn.Linear):
            def forward(self, x):
                while True: x = x + 0
        def audit_spec():
            start_all()
            return torchledger.AuditSpec(M(4, 6), torch.randn(2, 4))
    """, ["--timeout", "3"]),
    "os._exit(0) in audit_spec": ("""
        def audit_spec():
            start_all()
            os._exit(0)
    """, []),
    "SIGKILL in forward": ("""
        import signal
        class M(torch.nn.Linear):
            def forward(self, x):
                os.kill(os.getpid(), signal.SIGKILL)
        def audit_spec():
            start_all()
            return torchledger.AuditSpec(M(4, 6), torch.randn(2, 4))
    """, []),
    "input() in audit_spec": ("""
        def audit_spec():
            return input()
    """, ["--timeout", "20"]),
}

HARNESS = """
import contextlib, io, json, os, sys, time
import torch
from torchledger.audit.engine import run_audit
from torchledger.cli import cli
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from watch import survivors
warm, out_path, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
run_audit(warm, steps=1)
never_r, never_w = os.pipe()        # stdin: a terminal no one types into
os.dup2(never_r, 0)
for name, args, pids in cases:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args, standalone_mode=False)
    seconds = time.monotonic() - t0
    started = len(open(pids).read().splitlines()) if os.path.exists(pids) else 0
    left = survivors(pids, {gone}) if started else []
    with open(out_path, "a") as f:
        f.write(json.dumps({{"name": name, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                            "seconds": seconds, "started": started, "left": left}}) + "\\n")
"""

#: ``survivors(pids_file, within)``: the noted processes still alive after ``within`` seconds
#: (each then killed: they are the tests' own), as ``[pid, state, cmdline]``.
WATCH = '''
import os, signal, time
def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[19])
    except (OSError, ValueError, IndexError):
        return None
def _alive(noted):
    out = []
    for pid, start in noted:
        st = _stat(pid)
        if st is not None and st[1] == start and st[0] not in "ZX":   # a zombie is dead
            out.append((pid, start, st[0]))
    return out
def survivors(path, within):
    noted = [tuple(map(int, l.split())) for l in open(path).read().splitlines() if l.strip()]
    end = time.monotonic() + within
    left = _alive(noted)
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = _alive(noted)
    found = []
    for pid, start, state in left:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        found.append([pid, state, cmd.strip()[:80]])
        if _stat(pid) is not None and _stat(pid)[1] == start:
            os.kill(pid, signal.SIGKILL)
    return found
'''


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def _model(tmp, name, body, pids):
    path = tmp / name
    path.write_text(PRELUDE.format(pids=str(pids)).lstrip("\n") + textwrap.dedent(body))
    return path


def _line(text: str, body: str) -> int:
    """The line number in the model file (PRELUDE, then the dedented body) of ``text`` in
    ``body``."""
    before = len(PRELUDE.lstrip("\n").splitlines())
    return before + next(i for i, line in enumerate(textwrap.dedent(body).splitlines(), 1) if text in line)


@pytest.fixture(scope="module")
def watch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("watch")
    (tmp / "watch.py").write_text(WATCH)
    sys.path.insert(0, str(tmp))
    try:
        import watch as module
        yield module
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("watch", None)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, watch):
    """Every case of CASES through the CLI (in-process, in one harness process: torch imported
    once): name -> its outcome, with ``left``, the processes it started still alive."""
    tmp = tmp_path_factory.mktemp("children")
    (tmp / "watch.py").write_text(WATCH)
    cases = []
    for i, (name, (body, args)) in enumerate(CASES.items()):
        path = _model(tmp, f"case{i}.py", body, tmp / f"pids{i}.txt")
        cases.append([name, ["audit", str(path), "--steps", "1", *args], str(tmp / f"pids{i}.txt")])
    (tmp / "warm.py").write_text("import torch, torchledger\ndef audit_spec():\n"
                                 "    return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))\n")
    (tmp / "harness.py").write_text(HARNESS.format(gone=GONE_S))
    results = tmp / "results.jsonl"
    try:
        done = subprocess.run([sys.executable, str(tmp / "harness.py"), str(tmp / "warm.py"), str(results),
                               json.dumps(cases)], capture_output=True, text=True, env=_env(), timeout=240)
        note = f"harness exit {done.returncode}: {done.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        note = "harness hung (240 s)"
    found = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())} if results.exists() else {}
    for i, (name, _, pids) in enumerate(cases):
        found.setdefault(name, {"missing": note})
        found[name]["file"] = f"case{i}.py"
        if os.path.exists(pids):        # the harness died mid-case: what that case left, killed
            found[name].setdefault("left", watch.survivors(pids, 0))
    return found


def _one_line(outcome, *needles):
    assert outcome["code"] == 2, outcome
    assert outcome["stdout"] == "", outcome
    err = outcome["stderr"].strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("torchledger: error: "), err
    for n in needles:
        assert n in err, err
    return err


def _all_gone(outcome):
    assert "missing" not in outcome, outcome["missing"]
    assert outcome["started"] == 6, outcome          # 2 workers, 1 Process, 2 sleeps, 1 daemon
    assert outcome["left"] == [], f"still alive {GONE_S} s after the audit: {outcome['left']}"


def test_a_clean_audit_leaves_nothing_running(outcomes):
    """Was: the two sleeps and the daemon (the Process and the workers too, from a parent that
    had imported multiprocessing: the child's exit handlers are not the parent's) kept running."""
    o = outcomes["a clean audit"]
    _all_gone(o)
    assert o["code"] == 0, o["stderr"][-2000:]
    assert json.loads(o["stdout"])["totals"]["flops"]["forward"] == 2 * 2 * 4 * 6   # 96, as ever


def test_a_timeout_leaves_nothing_running(outcomes):
    o = outcomes["a hung forward at --timeout"]
    _all_gone(o)
    line = _line("while True", CASES["a hung forward at --timeout"][0])
    _one_line(o, "the audit did not finish within 3 s (--timeout); it was running ",
              f"{o['file']}:{line} in forward; stopped")


def test_os_exit_leaves_nothing_running(outcomes):
    o = outcomes["os._exit(0) in audit_spec"]
    _all_gone(o)
    line = _line("os._exit(0)", CASES["os._exit(0) in audit_spec"][0])
    _one_line(o, f"{o['file']}:{line}: the model file ended the audit's process with os._exit(0)")


def test_a_killed_child_leaves_nothing_running(outcomes):
    o = outcomes["SIGKILL in forward"]
    _all_gone(o)
    _one_line(o, "the audit's process ended (killed by signal SIGKILL) before the audit finished")


def test_the_model_file_cannot_read_the_terminal(outcomes):
    """The child's stdin is /dev/null: ``input()`` is an EOFError at once, one line (was: it
    waited on the terminal, here a pipe no one writes to, until --timeout)."""
    o = outcomes["input() in audit_spec"]
    assert "missing" not in o, o["missing"]
    line = _line("input(", CASES["input() in audit_spec"][0])
    _one_line(o, f"{o['file']}:{line}: audit_spec() raised EOFError")
    assert o["seconds"] < 15, o["seconds"]


# -- signals to `torchledger` itself (a real `python -m torchledger`, in its own process group as a
#    shell runs a foreground job) ------------------------------------------------------------------
HANG = """
def audit_spec():
    start_all()
    open({ready!r}, "w").write(str(os.getpid()))
    while True:
        time.sleep(0.05)
"""


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _until(check, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_a_signal_to_torchledger_ends_what_the_model_file_started(tmp_path, watch, how):
    """Ctrl-C (SIGINT to the foreground group: since the child has its own session, only
    torchledger gets it) stops the audit as before (exit 130, "aborted") and ends the model
    file's processes (was: the sleeps, which inherit the child's ignored SIGINT, and the
    daemon kept running). SIGTERM to torchledger alone (``kill PID``; ``timeout`` signals its
    whole group, which no longer holds the child) ends them too, then torchledger dies of
    SIGTERM as before (was: the child died with its parent, its processes stayed). Before the
    SIGTERM, Ctrl-Z (SIGTSTP to the group) stops the audit's child with torchledger, and
    SIGCONT continues both."""
    pids, ready = tmp_path / "pids.txt", tmp_path / "ready.txt"
    path = tmp_path / "m.py"
    path.write_text(PRELUDE.format(pids=str(pids)).lstrip("\n") + HANG.format(ready=str(ready)))
    proc = subprocess.Popen([sys.executable, "-m", "torchledger", "audit", str(path), "--steps", "1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(), cwd=tmp_path, process_group=0)
    try:
        assert _until(lambda: ready.exists() and ready.read_text().strip(), 60), "audit_spec never ran"
        child = int(ready.read_text())
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTSTP)
            assert _until(lambda: _state(child) == "T" and _state(proc.pid) == "T", 10), \
                (_state(child), _state(proc.pid))
            os.killpg(proc.pid, signal.SIGCONT)
            assert _until(lambda: _state(child) not in ("T", None) and _state(proc.pid) != "T", 10), \
                (_state(child), _state(proc.pid))
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        left = watch.survivors(pids, GONE_S) if pids.exists() else []
    assert len(pids.read_text().splitlines()) == 6
    assert left == [], f"still alive {GONE_S} s after torchledger ended: {left}"
    assert out == b""
    if how == "Ctrl-C":
        assert proc.returncode == 130, err[-2000:]
        assert err.decode().strip().splitlines()[-1] == "torchledger: aborted", err[-2000:]
    else:
        assert proc.returncode == -signal.SIGTERM, err[-2000:]


# -- the supervisor's own rules (no model file) ---------------------------------------------------
def test_a_child_reaped_elsewhere_is_never_signalled(monkeypatch):
    """Once the child is reaped (here: by someone else in this process), its pid and group id
    may name another process: ``end()`` and ``ended()`` signal nothing."""
    from torchledger.audit.supervise import _Child
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    child = _Child(pid)
    os.waitpid(pid, 0)                  # the reaping that is not the supervisor's
    sent = []
    monkeypatch.setattr(os, "kill", lambda *a: sent.append(("kill", *a)))
    monkeypatch.setattr(os, "killpg", lambda *a: sent.append(("killpg", *a)))
    assert child.ended() == 0 and child.end() == 0
    assert _Child(pid).end() == 0       # end() alone, as on a timeout
    assert sent == []


def test_the_reaper_kills_only_new_processes_of_another_session():
    """``_Reaper.finish`` kills this process's children that appeared since it started and
    are in another session (what left the audit's child's group, orphaned to it): not a
    child that was already there, not one in this session."""
    import threading
    from torchledger.audit.supervise import _Reaper, _stat
    if threading.active_count() != 1:
        pytest.skip("the reaper is off in a process with other Python threads")
    old = subprocess.Popen(["sleep", "30"], start_new_session=True)
    procs = [old]
    try:
        reaper = _Reaper()
        assert reaper.on
        here = subprocess.Popen(["sleep", "30"])
        new = subprocess.Popen(["sleep", "30"], start_new_session=True)
        procs += [here, new]
        started = _stat(new.pid)["start"]
        reaper.finish(_stat(here.pid)["start"])
        assert _stat(new.pid).get("start") != started   # killed and reaped (no /proc entry left)
        assert old.poll() is None and here.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
