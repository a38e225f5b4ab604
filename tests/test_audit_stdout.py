"""stdout is the format's alone: what the model file prints during an audit goes to stderr."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from torchledger.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: prints at import (nanoGPT prints its parameter count), in audit_spec(), in forward, and
#: writes to file descriptor 1 directly (as C code would)
CHATTY = """
    import os, sys, torch, torchledger
    print("number of parameters: 0.01M")
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
        def forward(self, x):
            print("forward called")
            return self.fc(x)
    def audit_spec():
        print("building")
        sys.stdout.write("raw write\\n")
        sys.stdout.flush()
        os.write(1, b"fd write\\n")
        return torchledger.AuditSpec(M(), torch.randn(2, 4))
"""


def _model(tmp_path):
    p = tmp_path / "chatty.py"
    p.write_text(textwrap.dedent(CHATTY))
    return str(p)


def test_cli_runner_json_stdout_is_only_the_report(tmp_path):
    r = CliRunner().invoke(cli, ["audit", _model(tmp_path), "--format", "json", "--steps", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)                  # nothing the model printed is in it
    assert data["schema"] == "torchledger/1"
    for said in ("number of parameters", "building", "raw write", "forward called"):
        assert said in r.stderr and said not in r.stdout


def test_subprocess_json_and_csv_stdout_parse(tmp_path):
    path = _model(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "torchledger", "audit", path, "--format", "json",
                          "--device", "cpu", "--steps", "1"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["totals"]["params"] == 4 * 3 + 3      # 15
    for said in ("number of parameters", "building", "raw write", "fd write", "forward called"):
        assert said in out.stderr and said not in out.stdout
    out = subprocess.run([sys.executable, "-m", "torchledger", "audit", path, "--format", "csv"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fd write" not in out.stdout and "building" not in out.stdout
    assert out.stdout.splitlines()[0].count(",") >= 3          # a CSV header first


def test_stdout_is_restored_after_the_audit(tmp_path, capfd):
    from torchledger.audit.engine import stdout_to_stderr
    with stdout_to_stderr():
        print("inside")
        os.write(1, b"inside-fd\n")
    print("after")
    out, err = capfd.readouterr()
    assert "inside" in err and "inside-fd" in err
    assert out == "after\n"


def test_a_dataclass_in_a_file_with_future_annotations_loads(tmp_path):
    """dataclasses look the class's module up in sys.modules (nanoGPT's GPTConfig pattern)."""
    p = tmp_path / "dc.py"
    p.write_text(textwrap.dedent("""
        from __future__ import annotations
        from dataclasses import dataclass
        import torch, torchledger
        @dataclass
        class Config:
            width: int = 4
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(Config().width, 2), torch.randn(3, 4))
    """))
    r = CliRunner().invoke(cli, ["audit", str(p), "--format", "json", "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["params"] == 4 * 2 + 2      # 10
