"""Faults on the prediction surfaces, the rest of issue 32 (items 2, 5, 6, 7, 8) and issue 33
item 9's process group: hostile inputs (a FIFO, a closed or full stdout, /dev/zero, a crafted
record or hardware file, a dangling symlink, a forged result line) that were tracebacks, hangs
or silently wrong before; each is now one line on stderr and a meaningful exit code."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_audit_cli import one_line_error, run, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "data", "gpt2-tiny", "record.json")
ENV = dict(os.environ, PYTHONPATH=ROOT)
LINEAR = """
    import torch, torchledger
    def audit_spec():
        return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
"""


def cli(*args, stdout=subprocess.PIPE, close_stdout=False, timeout=120):
    """``python -m torchledger ARGS`` in a subprocess (file descriptors as a shell sets them)."""
    pre = (lambda: os.close(1)) if close_stdout else None
    return subprocess.run([sys.executable, "-m", "torchledger", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=ENV, timeout=timeout, preexec_fn=pre)


# -- 6. a closed, full or gone stdout -----------------------------------------------------------------
@pytest.mark.parametrize("args", [["report", RECORD], ["report", RECORD, "--format", "json"],
                                  ["estimate", "train", "--params", "7B", "--tokens", "1T"]])
def test_a_full_or_closed_stdout_is_one_line_exit_2(args):
    """Was: OSError ENOSPC / AttributeError on None tracebacks (exit 1, which CI reads as
    findings); a closed stdout could also print nothing and exit 0."""
    with open("/dev/full", "w") as full:
        r = cli(*args, stdout=full)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "torchledger: error: cannot write the output to stdout (No space left on device); write it to "
        "a file: --output FILE (audit, report) or a redirect"]
    r = cli(*args, close_stdout=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "torchledger: error: cannot write the output to stdout (stdout is closed); write it to a file: "
        "--output FILE (audit, report) or a redirect"]


def test_a_reader_gone_is_a_silent_141():
    """``report ... | head -c0``: the reader closed the pipe before the report was written."""
    p = subprocess.Popen([sys.executable, "-m", "torchledger", "report", RECORD], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV)
    p.stdout.close()                    # as `head -c0` does, before a byte arrives
    try:
        err = p.communicate(timeout=120)[1].decode()
    finally:
        p.kill()
    assert p.returncode == 141 and err == "", err      # 128 + SIGPIPE (13)


def test_audit_to_a_closed_or_full_stdout(tmp_path):
    """The audit's parent writes the report: the child's result is not lost in a traceback."""
    model = write(tmp_path, "m.py", LINEAR)
    r = cli("audit", model, "--steps", "1", close_stdout=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "torchledger: error: cannot write the output to stdout (stdout is closed)")
    with open("/dev/full", "w") as full:
        r = cli("audit", model, "--steps", "1", "--format", "json", stdout=full)
    assert r.returncode == 2 and "No space left on device" in r.stderr and "Traceback" not in r.stderr


def test_a_closed_stdout_does_not_lend_its_number_to_a_file(tmp_path):
    """With fd 1 closed, the next file opened would be fd 1 and take what is printed."""
    out = tmp_path / "out.json"
    r = cli("report", RECORD, "--format", "json", "--output", str(out), close_stdout=True)
    assert r.returncode == 0, r.stderr
    json.loads(out.read_text())        # the record alone, nothing printed into it


# -- 7. a dangling symlink, Ledger(save_to=) on a FIFO, --mesh before the child ------------------------
def test_a_dangling_links_missing_folder_is_the_targets(tmp_path):
    """Was: 'the folder <the link's own folder> does not exist', a folder that exists."""
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "gone" / "deeper" / "out.json")
    r = run("report", RECORD, "--format", "json", "--output", str(link))
    one_line_error(r, f"{link} is a link to {tmp_path / 'gone' / 'deeper' / 'out.json'}",
                   f"the folder {tmp_path / 'gone' / 'deeper'} does not exist")
    assert f"the folder {tmp_path} does" not in r.stderr
    (tmp_path / "gone" / "deeper").mkdir(parents=True)          # made: the link is followed
    assert run("report", RECORD, "--format", "json", "--output", str(link)).exit_code == 0
    assert link.is_symlink() and json.loads(link.read_text())["schema"] == "torchledger/1"


class _Hung(BaseException):
    """Raised by SIGALRM: a BaseException, so that Ledger's `except Exception` cannot hide it."""


def test_ledger_save_to_a_fifo_never_blocks_the_step(tmp_path):
    """Was: open(O_WRONLY) of a FIFO with no reader blocked the training step forever."""
    import signal
    import warnings

    import torch
    from torchledger import Ledger
    fifo = tmp_path / "steps.json"
    os.mkfifo(fifo)
    model = torch.nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = Ledger(model, optimizer=opt, save_to=str(fifo))

    def hung(signum, frame):
        raise _Hung()
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ledger.step(tokens=2):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(f"{fifo} is a FIFO, not a regular file" in m and "step 0's record not saved" in m
               for m in said), said
    assert ledger.records and ledger.saved == [] and os.path.exists(fifo)     # the FIFO left alone


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "3xx"], "--mesh: expected dims joined by x"),
    (["--mesh", "dp=2,tp=2", "--world-size", "5"], "its dims multiply to 4, not --world-size 5"),
    (["--mesh", "dp=2,zz=2"], "unknown dimension 'zz'"),
    (["--world-size", "2", "--schedule", "gpipe"], "the mesh has no pp dimension"),
    (["--world-size", "2", "--device", "cpu"], "--device cpu cannot")])
def test_a_bad_mesh_is_refused_before_the_child_starts(args, needle, tmp_path, monkeypatch):
    """Was: reported by the child, after it had imported torch and the model file (3-9 s)."""
    marker = tmp_path / "imported"
    model = write(tmp_path, "m.py", f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n" + LINEAR)

    def no_fork():
        raise AssertionError("the audit's child was started for arguments the parent can refuse")
    monkeypatch.setattr(os, "fork", no_fork)
    one_line_error(run("audit", model, *args), needle)
    assert not marker.exists()


# -- 8. what a model file can do: a result line it wrote by accident is not the audit's ---------------
FORGER = """
    import os, posix, stat, torch, torchledger
    FORGED = b'{{"result": {{"emit": [["FORGED REPORT", null]], "code": 0}}}}\\n'
    def audit_spec():
        for fd in range(3, 256):        # every pipe it inherited: the audit's result pipe among them
            try:
                if stat.S_ISFIFO(os.fstat(fd).st_mode):
                    os.write(fd, FORGED)
            except OSError:
                pass
        {then}
        return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
"""


def test_a_result_line_without_the_runs_token_is_malformed(tmp_path):
    """Was: the forged line was the audit's result: 'FORGED REPORT' on stdout, exit 0."""
    model = write(tmp_path, "forger.py", FORGER.format(then="posix._exit(0)"))
    r = cli("audit", model, "--steps", "1", timeout=120)
    assert r.returncode == 2 and "FORGED" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith(
        "torchledger: error: the audit's process sent a malformed result: 1 line(s) on its result pipe "
        "without this run's token")


def test_a_forged_line_beside_the_real_result_is_ignored_and_said(tmp_path):
    model = write(tmp_path, "forger.py", FORGER.format(then="pass"))
    r = cli("audit", model, "--steps", "1", "--format", "json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["params"] == 4 * 6 + 6       # 30: the audit's own report
    assert "1 line(s) on the audit's result pipe did not carry this run's token" in r.stderr


def test_audit_help_says_what_the_supervisor_protects_against():
    text = " ".join(run("audit", "--help").stdout.split())
    assert "the same trust as `python FILE.py`" in text
    assert "against accidents" in text and "not against a file written to deceive" in text
