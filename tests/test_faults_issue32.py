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
