"""A model file cannot make ``audit`` lie to CI: it runs in a child process (cli/supervise.py)
whose result alone decides the exit code and stdout.

The cases that end or hang a process run through one harness subprocess (a Python process
that calls the CLI in-process for each case, torch imported once): should the supervisor
break, the harness dies or times out, never pytest. The others run through CliRunner.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_audit_cli import ROOT, one_line_error, run, write

LINEAR = """
    import torch, torchledger
    def audit_spec():
        return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
"""

#: name -> (model file, extra CLI args); the line numbers in TESTS below count from line 1
#: of the dedented file.
CASES = {
    "os._exit(0) at import": ("""
        import os
        os._exit(0)
    """, []),
    "os._exit(3) in audit_spec": ("""
        import os
        def audit_spec():
            os._exit(3)
    """, []),
    "SIGKILL in forward": ("""
        import os, signal, torch, torchledger
        class M(torch.nn.Linear):
            def forward(self, x):
                os.kill(os.getpid(), signal.SIGKILL)
        def audit_spec():
            return torchledger.AuditSpec(M(4, 6), torch.randn(2, 4))
    """, []),
    "loop at import": ("""
        import time
        while True:
            time.sleep(0.01)
    """, ["--timeout", "1"]),
    "loop in audit_spec": ("""
        def audit_spec():
            n = 0
            while n >= 0: n += 1
    """, ["--timeout", "2"]),
    "loop in forward": ("""
        import torch, torchledger
        class M(torch.nn.Linear):
            def forward(self, x):
                while True: x = x + 0
        def audit_spec():
            return torchledger.AuditSpec(M(4, 6), torch.randn(2, 4))
    """, ["--timeout", "3"]),
    "a thread printing after the report": ("""
        import threading, time, torch, torchledger
        def noise():
            while True:
                print("noise", flush=True)
                time.sleep(0.001)
        threading.Thread(target=noise, daemon=True).start()
    """ + LINEAR.replace("\n    ", "\n        "), ["--format", "json"]),
    "os._exit(5) in an exit handler after the report": ("""
        import atexit, os
        atexit.register(lambda: os._exit(5))
    """ + LINEAR.replace("\n    ", "\n        "), ["--format", "json"]),
}

HARNESS = """
import contextlib, io, json, sys, time
import torch
from torchledger.audit.engine import run_audit
from torchledger.cli import cli
warm, out_path, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
run_audit(warm, steps=1)        # every module an audit imports, imported once, here
for name, args in cases:
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args, standalone_mode=False)
    with open(out_path, "a") as f:
        f.write(json.dumps({"name": name, "code": code, "stdout": out.getvalue(),
                            "stderr": err.getvalue(), "seconds": time.monotonic() - t0}) + "\\n")
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case of CASES through the CLI, in one harness process: name -> its outcome."""
    tmp = tmp_path_factory.mktemp("faults")
    cases = []
    for i, (name, (body, args)) in enumerate(CASES.items()):
        path = tmp / f"case{i}.py"
        path.write_text(textwrap.dedent(body).lstrip("\n"))
        cases.append([name, ["audit", str(path), "--steps", "1", *args]])
    (tmp / "warm.py").write_text(textwrap.dedent(LINEAR))
    (tmp / "harness.py").write_text(HARNESS)
    results = tmp / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(tmp / "harness.py"), str(tmp / "warm.py"), str(results),
                               json.dumps(cases)], capture_output=True, text=True, env=env, timeout=240)
        note = f"harness exit {done.returncode}: {done.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        note = "harness hung (240 s)"
    lines = results.read_text().splitlines() if results.exists() else []
    found = {r["name"]: r for r in map(json.loads, lines)}
    for i, (name, _) in enumerate(cases):
        found.setdefault(name, {"missing": note})
        found[name]["file"] = f"case{i}.py"
    return found


def _one_line(outcome, *needles):
    assert "missing" not in outcome, outcome["missing"]
    assert outcome["code"] == 2, outcome
    assert outcome["stdout"] == "", outcome
    err = outcome["stderr"].strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("torchledger: error: "), err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("name, line", [("os._exit(0) at import", 2), ("os._exit(3) in audit_spec", 3)])
def test_os_exit_is_exit_2_naming_the_line(outcomes, name, line):
    """Was: exit 0 (or 3) with no output, a gate that passes."""
    o = outcomes[name]
    code = name[len("os._exit("):name.index(")")]
    _one_line(o, f"{o['file']}:{line}: the model file ended the audit's process with os._exit({code})",
              "there is no report")


def test_a_killed_process_is_exit_2(outcomes):
    _one_line(outcomes["SIGKILL in forward"], "the audit's process ended (killed by signal SIGKILL) before "
                                              "the audit finished")


@pytest.mark.parametrize("name, where", [("loop at import", ":3 in <module>"),
                                         ("loop in audit_spec", ":3 in audit_spec"),
                                         ("loop in forward", ":4 in forward")])
def test_a_hung_audit_stops_at_the_timeout_naming_where(outcomes, name, where):
    """Was: silent forever. Now: one line at --timeout with the model file's running frame."""
    o = outcomes[name]
    limit = dict(zip(*[iter(CASES[name][1])] * 2))["--timeout"]
    err = _one_line(o, f"the audit did not finish within {limit} s (--timeout); it was running ")
    assert f"{o['file']}{where}; stopped" in err, err
    assert o["seconds"] < float(limit) + 10, o["seconds"]      # stopped, not left running


def test_a_thread_printing_after_the_report_never_reaches_stdout(outcomes):
    o = outcomes["a thread printing after the report"]
    assert "missing" not in o, o["missing"]
    assert o["code"] == 0, o["stderr"][-2000:]
    assert json.loads(o["stdout"])["totals"]["flops"]["forward"] == 2 * 2 * 4 * 6   # 96
    assert "noise" in o["stderr"]                  # it went to stderr, while the child ran


def test_the_audit_result_decides_the_exit_code_not_an_exit_handler(outcomes):
    """The model file's exit handler runs (after the report was sent) and calls os._exit(5):
    the audit's own result (clean: 0) is the exit code."""
    o = outcomes["os._exit(5) in an exit handler after the report"]
    assert "missing" not in o, o["missing"]
    assert o["code"] == 0, o
    assert json.loads(o["stdout"])["schema"] == "torchledger/1"


# -- exceptions that were tracebacks (exit 1, the findings code) --------------------------------
def test_a_model_file_that_deletes_itself(tmp_path):
    path = write(tmp_path, "m.py", """
        import os, torch, torchledger
        def audit_spec():
            os.remove(__file__)
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """)
    r = run("audit", path, "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["flops"]["forward"] == 96
    assert "torchledger: warning: the model file was not linted:" in r.stderr


def test_a_model_file_that_changes_the_working_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    write(tmp_path, "m.py", """
        import os, torch, torchledger
        os.chdir("elsewhere")
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """)
    r = run("audit", "m.py", "--steps", "1", "--format", "json", cwd=tmp_path)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    assert rec["meta"]["audit"]["file"] == "m.py" and rec["meta"]["audit"]["spec_line"] == 4   # line 1 blank


@pytest.mark.parametrize("body, needles", [
    ("""
        def audit_spec():
            raise GeneratorExit("bye")
    """, ["m.py:3: audit_spec() raised GeneratorExit: bye"]),         # line 1 of the file is blank
    ("""
        class Bad(Exception):
            def __str__(self):
                raise ValueError("no str")
        def audit_spec():
            raise Bad()
    """, ["m.py:6: audit_spec() raised Bad: <its str() raised ValueError>"]),
    ("""
        import torch, torchledger
        from torch.utils._python_dispatch import TorchDispatchMode
        def _enter(self):
            raise RuntimeError("patched enter")
        TorchDispatchMode.__enter__ = _enter
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """, ["m.py:5: ", "RuntimeError: patched enter"]),
], ids=["GeneratorExit", "__str__ raises", "TorchDispatchMode.__enter__ patched"])
def test_hostile_exceptions_are_one_line_exit_2(tmp_path, monkeypatch, body, needles):
    from torch.utils._python_dispatch import TorchDispatchMode
    # NB: put back after the test should the model file's patch ever reach this process
    monkeypatch.setattr(TorchDispatchMode, "__enter__", TorchDispatchMode.__enter__)
    r = run("audit", write(tmp_path, "m.py", body), "--steps", "1")
    one_line_error(r, *needles)


def test_the_python_api_reports_them_as_audit_errors(tmp_path, monkeypatch):
    """``run_audit`` (in-process, no child) turns them into ``AuditError`` too, and gives the
    working directory back."""
    from torchledger.audit.engine import run_audit
    from torchledger.audit.spec import AuditError
    with pytest.raises(AuditError, match="audit_spec\\(\\) raised GeneratorExit: bye"):
        run_audit(write(tmp_path, "g.py", "def audit_spec():\n    raise GeneratorExit('bye')\n"))
    with pytest.raises(AuditError, match="raised Bad: <its str\\(\\) raised ValueError>"):
        run_audit(write(tmp_path, "b.py", """
            class Bad(Exception):
                def __str__(self):
                    raise ValueError
            def audit_spec():
                raise Bad()
        """))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    run = run_audit(write(tmp_path, "c.py", "import os\nos.chdir('elsewhere')\n" + textwrap.dedent(LINEAR)),
                    steps=1)
    assert os.getcwd() == str(tmp_path) and run.record.meta["audit"]["file"] == "c.py"


def test_debug_runs_the_model_file_in_this_process(tmp_path):
    """The model file runs in a child (its pid is not ours); ``--debug`` keeps it here
    (tracebacks, breakpoints)."""
    pid_file = tmp_path / "pid.txt"
    path = write(tmp_path, "m.py", f"""
        import os, torch, torchledger
        def audit_spec():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """)
    assert run("audit", path, "--steps", "1").exit_code == 0
    assert int(pid_file.read_text()) != os.getpid()
    assert run("--debug", "audit", path, "--steps", "1").exit_code == 0
    assert int(pid_file.read_text()) == os.getpid()


def test_timeout_must_be_a_number_of_seconds(tmp_path):
    r = run("audit", write(tmp_path, "m.py", LINEAR), "--timeout", "-1")
    one_line_error(r, "--timeout", "-1")


def test_where_names_the_users_frame_not_one_of_torchledgers_rooms(tmp_path, monkeypatch):
    """A failure raised inside torchledger (here units.parse_int, at the package root; before the
    rooms every engine module was there too) is placed at the deepest frame outside torch and
    torchledger: the library line that called it, not torchledger's own."""
    import importlib
    import sys as _sys

    from torchledger.audit.errors import where
    (tmp_path / "userlib.py").write_text("from torchledger.units import parse_int\n\n\n"
                                         "def bad():\n    return parse_int('many')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    userlib = importlib.import_module("userlib")
    try:
        userlib.bad()
    except ValueError as e:
        place = where(e, str(tmp_path / "model.py"))
    _sys.modules.pop("userlib", None)
    assert place.endswith("userlib.py:5"), place
