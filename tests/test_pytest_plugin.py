"""The pytest plugin (``torchledger_trace``, ``--torchledger-report``) run by pytest itself.

Each inner run is pytest in a subprocess with no plugin autoloaded but ours. NB: not
``pytester``'s in-process runs: they restore ``sys.modules`` afterwards, and a torch
submodule imported again re-registers its operator library, which torch refuses. One run
covers every traced inner test (torch is imported once); the others never import torch.

The step of every inner test: ``Sequential(Linear(8, 4), Linear(4, 2))``, no bias, on a
(2, 8) input that needs no grad, SGD, tokens=2. By hand:
    forward   2*2*8*4 + 2*2*4*2          = 128 + 32 = 160
    backward  layer 0: weight grad only    128
              layer 1: weight + input grad 32 + 32 = 64   -> 192
    total     352; per token 352 / 2 = 176
    activations saved: x (2*8*4 B = 64) and the hidden (2*4*4 B = 32) = 96 B
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from torchledger.record import StepRecord
from torchledger.testing import assert_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FWD = 2 * 2 * 8 * 4 + 2 * 2 * 4 * 2          # 160
BWD = 2 * 2 * 8 * 4 + 2 * (2 * 2 * 4 * 2)    # 192
TOTAL = FWD + BWD                            # 352
ACT = 2 * 8 * 4 + 2 * 4 * 4                  # 96 B

INNER = """
import torch
from torchledger.testing import assert_step

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 8)

def step(model, opt, x):
    model(x).sum().backward(); opt.step(); opt.zero_grad()

def test_within(torchledger_trace):
    model, opt, x = make()
    with torchledger_trace(model, optimizer=opt, tokens=2) as t:
        step(model, opt, x)
    assert_step(t.record, max_peak_bytes="1MiB", max_flops_per_token=176,
                max_activation_bytes=96, no_findings_at="warning")

def test_over(torchledger_trace):
    model, opt, x = make()
    with torchledger_trace(model, optimizer=opt, tokens=2) as t:
        step(model, opt, x)
    assert_step(t.record, max_flops_per_token="100", max_activation_bytes=64, max_peak_bytes=100)

def test_two(torchledger_trace):
    model, opt, x = make()
    for _ in range(2):
        traced = torchledger_trace(model, optimizer=opt, tokens=2)
        with traced:
            step(model, opt, x)
        assert_step(traced, max_flops=352)      # the fixture's object reads as the trace
    assert len(torchledger_trace.records) == 2

def test_untraced():
    pass

def test_left_open(torchledger_trace):
    model, opt, x = make()
    torchledger_trace(model, optimizer=opt, tokens=2).__enter__()
    model(x).sum().backward()
    raise RuntimeError("the test fails inside the step")

def test_zz_nothing_left_installed():
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torchledger.tracer import active_tracer
    assert active_tracer() is None
    assert not m._global_forward_hooks and not m._global_forward_pre_hooks
    assert not o._global_optimizer_pre_hooks and not o._global_optimizer_post_hooks
    assert not _get_current_dispatch_mode_stack()

def test_zz_traces_again(torchledger_trace):
    model, opt, x = make()
    with torchledger_trace(model, optimizer=opt, tokens=2) as t:
        step(model, opt, x)
    assert t.record.totals["flops"]["total"] == 352
"""


def _entry_point_installed() -> bool:
    from importlib import metadata
    try:
        eps = metadata.entry_points(group="pytest11")
    except TypeError:                                    # Python < 3.10
        eps = metadata.entry_points().get("pytest11", [])
    return any(ep.name == "torchledger" and ep.value == "torchledger.pytest_plugin" for ep in eps)


def plugin_args() -> list:
    """Load the plugin once: by its entry point name when torchledger is installed with it
    (naming the module too would register it twice, which pytest refuses), else by module."""
    return ["-p", "torchledger"] if _entry_point_installed() else ["-p", "torchledger.pytest_plugin"]


def pytest_run(cwd, *args, path=(), plugin=None):
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([*map(str, path), ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(plugin or plugin_args()), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def inner(tmp_path_factory):
    """The inner suite, run once with ``--torchledger-report out/nested`` (not there yet)."""
    d = tmp_path_factory.mktemp("inner")
    (d / "test_budget.py").write_text(INNER)
    proc = pytest_run(d, "--torchledger-report", "out/nested", "-W", "always", "test_budget.py")
    return proc, d / "out" / "nested"


@pytest.mark.slow      # the inner suite: one pytest + torch start, shared by 4 tests
def test_outcomes(inner):
    proc, _ = inner
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^2 failed, 5 passed", proc.stdout.splitlines()[-1]), proc.stdout
    assert "FAILED test_budget.py::test_over" in proc.stdout
    assert "FAILED test_budget.py::test_left_open - RuntimeError" in proc.stdout


@pytest.mark.slow
def test_broken_budget_names_the_numbers_and_modules(inner):
    proc, out = inner
    text = proc.stdout
    over = TOTAL // 2 - 100                                  # 176 - 100 = 76 (+76.0%)
    assert f"FLOPs per token: {TOTAL // 2} > max_flops_per_token 100, over by {over} (+76.0%)" in text
    # 96 B - 64 B = 32 B (+50.0%)
    assert f"activation bytes: {ACT} B > max_activation_bytes 64 B, over by 32 B (+50.0%)" in text
    # the message quotes the peak the written record holds
    peak = json.loads((out / "test_budget.py_test_over-0.json").read_text())["totals"]["peak_bytes"]
    assert f"peak bytes: {peak:,} B" in text and f"max_peak_bytes 100 B, over by {peak - 100:,} B" in text
    # FLOPs per module, largest first: layer 0 128+128 = 256 of 352 (72.7%), layer 1 32+64 = 96
    rows = [line.split() for line in text.splitlines() if re.match(r"E\s+[01]\s+Linear", line)]
    assert ["E", "0", "Linear", "256", "72.7%", "256"] in rows, text
    assert ["E", "1", "Linear", "96", "27.3%", "96"] in rows, text
    assert rows.index(["E", "0", "Linear", "256", "72.7%", "256"]) + 1 == \
        rows.index(["E", "1", "Linear", "96", "27.3%", "96"])
    # activations: layer 0 saves x (64 B of 96, 66.7%), layer 1 the hidden (32 B, 33.3%)
    assert ["E", "0", "Linear", "64", "B", "66.7%", "64", "B"] in rows, text
    assert ["E", "1", "Linear", "32", "B", "33.3%", "32", "B"] in rows, text
    # pytest points at the test's own line, not into assert_step
    assert re.search(r'^>\s+assert_step\(t\.record, max_flops_per_token="100"', text, re.M), text
    assert "torchledger/testing.py" not in text


@pytest.mark.slow
def test_report_writes_every_traced_record_and_an_index(inner):
    proc, out = inner
    names = sorted(p.name for p in out.iterdir())
    assert names == ["index.json", "test_budget.py_test_left_open-0.json", "test_budget.py_test_over-0.json",
                     "test_budget.py_test_two-0.json", "test_budget.py_test_two-1.json",
                     "test_budget.py_test_within-0.json", "test_budget.py_test_zz_traces_again-0.json"]
    index = json.loads((out / "index.json").read_text())
    assert index["schema"] == "torchledger.pytest/1"
    # the test's outcome (test_over failed at assert_step, its step did not) and the step's
    assert [(e["nodeid"], e["trace"], e["outcome"], e["failed"], e["step_failed"]) for e in index["records"]] == [
        ("test_budget.py::test_within", 0, "passed", False, False),
        ("test_budget.py::test_over", 0, "failed", True, False),
        ("test_budget.py::test_two", 0, "passed", False, False), ("test_budget.py::test_two", 1, "passed", False, False),
        ("test_budget.py::test_left_open", 0, "failed", True, True),
        ("test_budget.py::test_zz_traces_again", 0, "passed", False, False)]
    for entry in index["records"]:
        rec = StepRecord.from_json((out / entry["file"]).read_text())
        assert rec.totals["flops"]["forward"] == FWD
        if not entry["step_failed"]:
            assert rec.totals["flops"]["total"] == entry["flops_total"] == TOTAL
            assert rec.totals["activation_bytes"] == ACT
    assert f"torchledger: 6 records written to {out}" in proc.stdout
    # a saved record is an assert_step input as it is
    assert_step(str(out / "test_budget.py_test_two-1.json"), max_flops=TOTAL, max_activation_bytes=ACT)
    with pytest.raises(AssertionError, match=f"FLOPs .*: {TOTAL} > max_flops {TOTAL - 1}, over by 1 "):
        assert_step(out / "test_budget.py_test_two-1.json", max_flops=TOTAL - 1)


@pytest.mark.slow
def test_fixture_removes_a_trace_the_test_left_active(inner):
    """test_left_open enters a trace and raises inside it; the fixture's teardown exits it, so
    the checks after it find no hook, mode or active tracer, and a new trace works."""
    proc, out = inner
    assert "a trace was still active when the test ended; the fixture removed its hooks" in proc.stdout
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    assert failed == ["test_budget.py::test_over", "test_budget.py::test_left_open"], proc.stdout


def test_report_dir_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "taken.txt").write_text("x")
    (tmp_path / "test_nothing.py").write_text("def test_a():\n    pass\n")
    proc = pytest_run(tmp_path, "--torchledger-report", "taken.txt", "test_nothing.py")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "--torchledger-report taken.txt: exists and is not a directory" in proc.stderr


def _sys_read_only() -> bool:
    import tempfile
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            return False
    except OSError:
        return os.path.isdir("/sys")


@pytest.mark.skipif(not _sys_read_only(), reason="needs Linux's read-only /sys")
def test_report_dir_that_cannot_take_a_file_is_a_usage_error(tmp_path):
    """An existing directory no file can be written in (sysfs is read-only even for root):
    the start-up check says so in one line, before any test runs."""
    (tmp_path / "test_nothing.py").write_text("def test_a():\n    pass\n")
    proc = pytest_run(tmp_path, "--torchledger-report", "/sys", "test_nothing.py")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "torchledger-report" in x]
    assert "--torchledger-report /sys: cannot write a file in the directory" in line, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_full_directory_fails_the_start_up_check(tmp_path, monkeypatch):
    import errno
    from torchledger import pytest_plugin

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pytest_plugin.os, "write", full)
    assert pytest_plugin._cannot_write(str(tmp_path)) == os.strerror(errno.ENOSPC)
    monkeypatch.undo()
    assert pytest_plugin._cannot_write(str(tmp_path)) is None and list(tmp_path.iterdir()) == []


def test_a_record_that_cannot_be_written_later_is_a_warning(tmp_path):
    """The directory went away (or filled) during the run: a warning and a summary line, not
    an error at every traced test's teardown."""
    from torchledger.pytest_plugin import _Report
    r = _Report(str(tmp_path / "gone"))
    with pytest.warns(RuntimeWarning, match="t.py_test_a-0.json not written"):
        r.write("t.py::test_a", [StepRecord()])
    assert r.entries == [] and r.unwritten[0].startswith("t.py_test_a-0.json: ")
    assert r.write_index() is None and r.unwritten[1].startswith("index.json: ")


XDIST_INNER = """
import torch

def test_a(torchledger_trace):
    model = torch.nn.Linear(8, 4, bias=False)
    with torchledger_trace(model, tokens=2) as t:
        model(torch.randn(2, 8)).sum().backward()
    assert t.record.totals["flops"]["total"] == 2 * (2 * 2 * 8 * 4)   # forward 128 + weight grad 128

def test_b(torchledger_trace):
    model = torch.nn.Linear(8, 4, bias=False)
    with torchledger_trace(model, tokens=2) as t:
        model(torch.randn(2, 8)).sum().backward()
    assert t.record.totals["flops"]["total"] == 0, "fails on purpose"
"""


@pytest.mark.slow      # two xdist workers, each starting torch
def test_xdist_workers_records_make_one_index_and_the_summary(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_x.py").write_text(XDIST_INNER)
    proc = pytest_run(tmp_path, "-p", "xdist", "-n", "2", "--torchledger-report", "rep", "test_x.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"torchledger: 2 records written to {tmp_path / 'rep'}" in proc.stdout, proc.stdout
    index = json.loads((tmp_path / "rep" / "index.json").read_text())
    assert [(e["nodeid"], e["outcome"], e["failed"]) for e in index["records"]] == [
        ("test_x.py::test_a", "passed", False), ("test_x.py::test_b", "failed", True)]
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "index.json", "test_x.py_test_a-0.json", "test_x.py_test_b-0.json"]


def test_report_file_names_are_sanitized_and_kept_apart():
    from torchledger.pytest_plugin import _Report
    r = _Report("unused")
    a = r.stem("tests/test_a.py::test_x[a/b c]")
    assert a == "tests_test_a.py_test_x_a_b_c"
    assert r.stem("tests/test_a.py::test_x[a/b c]") == a                  # same test, same stem
    b = r.stem("tests/test_a.py::test_x[a b/c]")                          # reads alike: kept apart
    assert b.startswith(a + "-") and b != a
    long = r.stem("t.py::test[" + "x" * 300 + "]")
    assert len(long) <= 111 and re.fullmatch(r"[A-Za-z0-9._-]+", long)


def test_entry_point_is_declared_in_pyproject():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    try:
        import tomllib
    except ImportError:                                  # Python < 3.11
        tomllib = None
    if tomllib is not None:
        eps = tomllib.loads(text)["project"]["entry-points"]["pytest11"]
    else:
        block = re.search(r"^\[project\.entry-points\.pytest11\]\n((?:[^\[\n].*\n)*)", text, re.M)
        eps = dict(re.findall(r'^(\S+)\s*=\s*"([^"]+)"', block.group(1), re.M))
    assert eps == {"torchledger": "torchledger.pytest_plugin"}


def test_entry_point_loads_the_plugin_without_importing_torch(tmp_path):
    """Find the plugin the way an installed torchledger offers it: a dist-info whose
    entry_points.txt carries pyproject's pytest11 line (what pip writes), loaded by its entry
    point name; a test that asks for the fixture still has no torch imported."""
    site = tmp_path / "site"
    dist = site / "torchledger_entrypoint_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchledger-entrypoint-probe\n"
                                   "Version: 0.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\ntorchledger = torchledger.pytest_plugin\n")
    (tmp_path / "test_startup.py").write_text(textwrap.dedent("""
        import sys

        def test_startup(request):
            assert "torch" not in sys.modules, "the plugin imported torch at startup"
            factory = request.getfixturevalue("torchledger_trace")
            assert type(factory).__name__ == "TraceFactory" and "torch" not in sys.modules
            plugin = request.config.pluginmanager.get_plugin("torchledger")
            assert plugin is sys.modules["torchledger.pytest_plugin"]
    """))
    proc = pytest_run(tmp_path, "--torchledger-report", "rep", "test_startup.py", path=[site],
                      plugin=["-p", "torchledger"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "rep" / "index.json").read_text())["records"] == []
