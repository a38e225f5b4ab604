"""``torchledger snapshot`` on hostile input: files that are not regular files, malformed
shapes, and pickles whose shared references would make the work explode. Every input gives
exit 0 with valid output or exit 2 with one line on stderr."""
import json
import os
import pickle
import subprocess
import sys

import pytest
from click.testing import CliRunner

from torchledger.analyzers.snapshot import SnapshotError, load_snapshot
from torchledger.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "data", "snapshots"))
import make  # noqa: E402  (tests/data/snapshots/make.py: the synthetic snapshots)


def run(*args):
    return CliRunner().invoke(cli, ["snapshot", *args])


def one_line(r, *needles) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("torchledger: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr
    return r.stderr


# -- not a regular file (item 6) ---------------------------------------------------------------
def test_dev_zero_is_refused_not_read():
    one_line(run("/dev/zero"), "/dev/zero: is a device")
    with pytest.raises(SnapshotError, match="is a device"):
        load_snapshot("/dev/zero")


def test_a_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "snap.pickle"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "torchledger", "snapshot", str(fifo)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "is a FIFO" in out.stderr


def test_a_directory_is_one_line(tmp_path):
    one_line(run(str(tmp_path)), "is a directory")
