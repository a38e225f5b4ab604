"""``--output``: a path ending in a separator is a usage error, and the temporaries of a write
killed outright are removed by the next write to the same file."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.render import write_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "data", "gpt2-tiny", "record.json")
SNAPSHOT = os.path.join(ROOT, "tests", "data", "snapshots", "history.pickle")


def run(*args):
    return CliRunner().invoke(cli, list(args))


def one_line_usage_error(r, *needles):
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("torchledger: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


# -- a path ending in a separator ---------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["report", RECORD, "--format", "json"],
    ["report", RECORD],                                   # format would come from the name
    ["snapshot", SNAPSHOT],
    ["snapshot", SNAPSHOT, "--format", "json"],
])
def test_output_ending_in_a_separator_is_a_usage_error(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    r = run(*args, "--output", "newdir/")
    one_line_usage_error(r, "--output", "'newdir/' ends in a path separator", "names a directory")
    assert os.listdir(tmp_path) == []                     # no file named newdir, no temporary


def test_audit_refuses_it_before_running_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("def audit_spec():\n    raise SystemExit('the model ran')\n")
    r = run("audit", "m.py", "--format", "json", "--output", "out/")
    one_line_usage_error(r, "'out/' ends in a path separator")
    assert sorted(os.listdir(tmp_path)) == ["m.py"]


def test_write_atomic_refuses_a_trailing_separator(tmp_path):
    with pytest.raises(IsADirectoryError, match="ends in a path separator"):
        write_atomic(str(tmp_path / "newdir") + os.sep, "x")
    assert os.listdir(tmp_path) == []


# -- temporaries left by a killed write --------------------------------------------------------
CHILD = textwrap.dedent("""
    import sys, time
    from torchledger.render import write_atomic

    def chunks():
        yield "partial"
        print("writing", flush=True)      # the temporary exists and holds a chunk
        time.sleep(120)
        yield "never"

    write_atomic(sys.argv[1], chunks())
""")


def _temporaries(directory, name):
    return sorted(f for f in os.listdir(directory) if f.startswith(f".{name}.") and f.endswith(".tmp"))


def test_a_write_killed_by_sigkill_leaves_a_temporary_the_next_write_removes(tmp_path):
    target = tmp_path / "out.json"
    target.write_text('{"old": 1}')
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(target)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    left = _temporaries(tmp_path, "out.json")
    assert len(left) == 1 and left[0].startswith(f".out.json.torchledger-{child.pid}."), left
    assert json.loads(target.read_text()) == {"old": 1}    # the kill left the old file whole

    write_atomic(target, '{"new": 2}')
    assert _temporaries(tmp_path, "out.json") == []
    assert json.loads(target.read_text()) == {"new": 2}
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_only_this_tools_stale_temporaries_for_this_target_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                            # a pid that is gone now
    live = os.getpid()                                     # a live writer (here, ourselves)
    keep = [f".out.json.torchledger-{live}.abc123.tmp",    # a write in progress
            f".other.json.torchledger-{dead.pid}.abc123.tmp",   # another target's
            ".out.json.abc123.tmp",                        # not named by this tool
            f".out.json.torchledger-{dead.pid}.tmp",       # no random part: not ours either
            "out.json.torchledger-notapid.x.tmp"]
    stale = f".out.json.torchledger-{dead.pid}.q1w2e3.tmp"
    for name in keep + [stale]:
        (tmp_path / name).write_text("x")
    os.mkdir(tmp_path / f".out.json.torchledger-{dead.pid}.dir.tmp")   # not a regular file
    write_atomic(tmp_path / "out.json", "new")
    assert (tmp_path / "out.json").read_text() == "new"
    assert not (tmp_path / stale).exists()
    assert all((tmp_path / name).exists() for name in keep)
    assert (tmp_path / f".out.json.torchledger-{dead.pid}.dir.tmp").is_dir()


def test_the_temporary_is_named_after_the_target_and_the_pid(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_atomic(tmp_path / "r.csv", "a,b\n")
    assert len(seen) == 1 and seen[0].startswith(f".r.csv.torchledger-{os.getpid()}.")
    assert seen[0].endswith(".tmp")
