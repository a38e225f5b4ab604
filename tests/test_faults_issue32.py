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


# -- 2. calibrate: its output, its inputs, the fit's bounds, the GPU a record was measured on ---------
def _cuda_record(path, seconds=0.01, gpu="NVIDIA H100 80GB HBM3"):
    """A measured CUDA step of four 8192^3 bf16 matmuls: 4 * 2 * 8192^3 = 4.4e12 FLOPs, 4.4 ms at
    H100's 989.5 TFLOP/s peak, so the default row predicts a few ms."""
    from torchledger.record import StepRecord
    rec = StepRecord()
    rec.meta.update(device="cuda", dtype="bfloat16", **({"gpu": gpu} if gpu else {}))
    rec.totals.update(tokens=1024, hardware_flops=0, step_seconds=seconds, params=1, peak_bytes=1,
                      activation_bytes=0)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0}
    rec.ops = [{"op": "aten.mm.default", "phase": "forward", "module": "a", "kind": "matmul", "count": 4,
                "flops": 4 * 2 * 8192 ** 3, "shapes": [{"mnk": [1, 8192, 8192, 8192], "dtype": "bf16",
                                                       "count": 4, "flops": 4 * 2 * 8192 ** 3}]}]
    return rec.save(str(path))


def test_calibrate_refuses_to_write_over_one_of_its_records(tmp_path):
    """Was: the record rewritten into a hardware table."""
    rec = _cuda_record(tmp_path / "r.json")
    before = open(rec, "rb").read()
    (tmp_path / "link.json").symlink_to(rec)
    os.link(rec, tmp_path / "hard.json")
    for out in (rec, str(tmp_path / "link.json"), str(tmp_path / "hard.json")):
        one_line_error(run("calibrate", rec, "--gpu", "h100", "--output", out),
                       f"--output {out}: is the input record {rec}", "write elsewhere")
    assert open(rec, "rb").read() == before


#: an existing --output calibrate cannot update -> what the line names (were tracebacks)
HOSTILE_OUTPUT = {
    "a list": ("[1, 2]", "got list"),
    "a row not an object": ('{"H100 SXM": 5}', "part 'H100 SXM': expected an object of fields"),
    "deep nesting": ("[" * 100_000, "nested too deep"),
    "efficiency not an object": ('{"H100 SXM": {"efficiency": 3}}', "part 'H100 SXM': efficiency"),
    "sources not an object": ('{"H100 SXM": {"sources": [1]}}', "part 'H100 SXM': sources"),
    "not JSON": ('{"H100 SXM": ', "not valid JSON"),
    "another part's bad row": ('{"Z9": {"memory": -1}}', "part 'Z9': memory"),
}


@pytest.mark.parametrize("case", list(HOSTILE_OUTPUT))
def test_calibrate_an_existing_output_it_cannot_update_is_one_line(case, tmp_path):
    text, needle = HOSTILE_OUTPUT[case]
    out = tmp_path / "hw.json"
    out.write_text(text)
    one_line_error(run("calibrate", _cuda_record(tmp_path / "r.json"), "--gpu", "h100", "--output", str(out)),
                   f"--output {out}: exists and is not a hardware file calibrate can update", needle)
    assert out.read_text() == text


def test_calibrate_makes_a_missing_folder_and_keeps_the_rows_other_fields(tmp_path):
    """Was: FileNotFoundError naming the temporary; now made, as audit --output makes it."""
    out = tmp_path / "new" / "deeper" / "hw.json"
    r = run("calibrate", _cuda_record(tmp_path / "r.json"), "--gpu", "h100", "--output", str(out))
    assert r.exit_code == 0, r.output
    row = json.loads(out.read_text())["H100 SXM"]
    out.write_text(json.dumps({"H100 SXM": {**row, "nic": "25GB/s", "efficiency": {
        **row["efficiency"], "matmul_min_intensity": 100}}, "L4": {"efficiency": {"launch_s": 7e-6}}}))
    assert run("calibrate", str(tmp_path / "r.json"), "--gpu", "h100", "--output", str(out)).exit_code == 0
    table = json.loads(out.read_text())
    assert table["L4"] == {"efficiency": {"launch_s": 7e-6}}
    assert table["H100 SXM"]["nic"] == "25GB/s"
    assert table["H100 SXM"]["efficiency"]["matmul_min_intensity"] == 100


def test_calibrate_never_reads_a_device_or_fifo_output(tmp_path):
    """Was: --output /dev/zero read without bound (24 GB before the kernel killed it); a FIFO
    --output opened for reading, which hangs with no writer."""
    import resource
    import threading
    import time
    rec = _cuda_record(tmp_path / "r.json")

    def small():                        # the old unbounded read fails fast instead of eating the host
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    r = subprocess.run([sys.executable, "-m", "torchledger", "calibrate", rec, "--gpu", "h100", "--output",
                        "/dev/zero"], capture_output=True, text=True, env=ENV, timeout=60, preexec_fn=small)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    fifo = tmp_path / "hw.fifo"
    os.mkfifo(fifo)
    got = bytearray()

    def read():                         # non-blocking: a calibrate that never writes cannot hang it
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        end = time.monotonic() + 60
        try:
            while time.monotonic() < end:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    chunk = None
                if chunk:
                    got.extend(chunk)
                elif chunk == b"" and got:
                    return              # the writer came and closed
                time.sleep(0.01)
        finally:
            os.close(fd)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        r = subprocess.run([sys.executable, "-m", "torchledger", "calibrate", rec, "--gpu", "h100", "--output",
                            str(fifo)], capture_output=True, text=True, env=ENV, timeout=60)
    finally:
        reader.join(70)
    assert r.returncode == 0, r.stderr
    assert "H100 SXM" in json.loads(bytes(got))


def test_calibrate_refuses_a_fifo_record(tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    one_line_error(run("calibrate", str(fifo), "--gpu", "h100", "--output", str(tmp_path / "hw.json")),
                   "is a FIFO; expected a regular record JSON file")


def test_calibrate_says_when_a_fit_is_pinned_at_a_bound(tmp_path):
    """Was: written without a word. A step measured at 100 s that the default H100 row predicts
    in ms asks for a matmul fraction far under the lowest the fit allows (0.05)."""
    out = tmp_path / "hw.json"
    r = run("calibrate", _cuda_record(tmp_path / "r.json", seconds=100.0), "--gpu", "h100", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert ("torchledger: warning: H100 SXM: matmul_peak_fraction = 0.05 is at its lower bound (0.05): the "
            "records ask for a part slower than the model allows; written as fitted") in r.stderr
    row = json.loads(out.read_text())["H100 SXM"]
    assert row["efficiency"]["matmul_peak_fraction"] == pytest.approx(0.05, rel=1e-3)
    assert "at a bound: matmul_peak_fraction" in row["sources"]["efficiency"]
    ok = run("calibrate", _cuda_record(tmp_path / "ok.json"), "--gpu", "h100", "--output", str(tmp_path / "ok"))
    assert ok.exit_code == 0 and "bound" not in ok.stderr         # 10 ms: inside the bounds


def test_calibrate_refuses_records_of_another_part(tmp_path):
    """Was: nothing said which GPU a record was measured on, so an A100's times fitted H100's row.
    Decided: a record of another part is refused (its times would set the wrong part's row); a
    record that does not say (older records) is taken as --gpu's, with a warning."""
    out = str(tmp_path / "hw.json")
    a100 = _cuda_record(tmp_path / "a.json", gpu="NVIDIA A100-SXM4-80GB")
    one_line_error(run("calibrate", _cuda_record(tmp_path / "h.json"), a100, "--gpu", "h100", "--output", out),
                   f"{a100}: measured on NVIDIA A100-SXM4-80GB (A100 SXM), not on --gpu H100 SXM")
    odd = _cuda_record(tmp_path / "odd.json", gpu="Some Accelerator 9")
    one_line_error(run("calibrate", odd, "--gpu", "h100", "--output", out),
                   "no known part; if it is H100 SXM, add 'Some Accelerator 9' to its aliases")
    assert not os.path.exists(out)
    r = run("calibrate", _cuda_record(tmp_path / "h.json"), "--gpu", "h100", "--output", out)
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr
    r = run("calibrate", _cuda_record(tmp_path / "old.json", gpu=None), str(tmp_path / "h.json"), "--gpu", "h100",
            "--output", out)
    assert r.exit_code == 0
    assert "1 of 2 record(s) do not say which GPU they were measured on (meta.gpu; older records)" in r.stderr


def test_a_cuda_records_gpu_is_the_device_name(monkeypatch):
    """meta.gpu of a real CUDA step: torch.cuda.get_device_name, which get_gpu resolves."""
    import torch
    from torchledger.formulas.hardware import get_gpu
    from torchledger.tracer.build import device_gpu
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert device_gpu(torch.device("cuda", 0)) == "NVIDIA H100 80GB HBM3"
    assert get_gpu(device_gpu(torch.device("cuda", 0))).name == "H100 SXM"

    def no_driver(d=None):
        raise RuntimeError("Found no NVIDIA driver on your system")
    monkeypatch.setattr(torch.cuda, "get_device_name", no_driver)
    assert device_gpu(torch.device("cuda", 0)) is None


def test_calibrate_shows_progress_for_many_records(tmp_path):
    """Was: about 0.5 s a record with nothing shown."""
    paths = [_cuda_record(tmp_path / f"r{i}.json") for i in range(8)]
    r = run("calibrate", *paths, "--gpu", "h100", "--output", str(tmp_path / "hw.json"))
    assert r.exit_code == 0, r.output
    assert "torchledger: calibrate: reading record 1 of 8" in r.stderr
    assert "torchledger: calibrate: sweep 1 of at most 6: rms log error" in r.stderr
    few = run("calibrate", *paths[:7], "--gpu", "h100", "--output", str(tmp_path / "hw7.json"))
    assert "calibrate:" not in few.stderr


# -- 5. estimate: its one file input is TORCHLEDGER_HARDWARE -----------------------------------------
#: a hostile hardware file -> what the one line says (before item 1's checks: tracebacks from the
#: default part's lookup, ``estimate train`` without --gpu, and a hang on a FIFO)
HOSTILE_FILES = {
    "directory": (None, "is a directory"),
    "binary": (bytes(range(256)) * 4, "not UTF-8 text"),
    "huge": ("sparse", "larger than 4 MiB"),
    "bad JSON": (b'{"H100": ', "not valid JSON"),
    "a list": (b"[1, 2]", "got list"),
    "row a number": (b'{"H100": 5}', "part 'H100': expected an object of fields"),
    "nvlink a list": (b'{"H100": {"nvlink": [1]}}', "part 'H100': nvlink"),
    "deep": (b"[" * 100_000, "nested too deep"),
    "byte-order mark": (b"\xff\xfe{}", "not UTF-8 text"),
}
ESTIMATES = [["train", "--params", "7B", "--tokens", "1T"], ["memory", "--params", "7B", "--gpu", "a100"],
             ["decode", "--params", "7B", "--gpu", "h100"],
             ["train", "--params", "7B", "--tokens", "1T", "--gpu", "h100", "--json"]]


@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_estimate_on_a_hostile_hardware_file_is_one_line(case, tmp_path, monkeypatch):
    content, needle = HOSTILE_FILES[case]
    path = tmp_path / "hw.json"
    if content is None:
        path.mkdir()
    elif content == "sparse":
        with open(path, "wb") as f:
            f.truncate(5 << 20)         # 5 MiB of zeros, none written
    else:
        path.write_bytes(content)
    monkeypatch.setenv("TORCHLEDGER_HARDWARE", str(path))
    for args in ESTIMATES:
        r = run("estimate", *args)
        one_line_error(r, f"TORCHLEDGER_HARDWARE={path}: ", needle)
        assert r.stdout == ""


def test_estimate_on_a_hardware_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "hw.json"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "torchledger", "estimate", "train", "--params", "7B", "--tokens", "1T"],
                       capture_output=True, text=True, env=dict(ENV, TORCHLEDGER_HARDWARE=str(fifo)), timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"torchledger: error: TORCHLEDGER_HARDWARE={fifo}: is a FIFO; expected a regular hardware JSON file (save "
        f"it to a file first); fix the file (or unset TORCHLEDGER_HARDWARE)"]


# -- issue 33 item 9: the model file's processes end with the audit from a threaded parent ------------
@pytest.fixture(scope="module")
def threaded_outcomes(tmp_path_factory):
    """The cases of test_audit_children, run through the CLI in-process from a parent with a
    second thread (as a program that calls the CLI from its own threads): the parent's
    subreaper sweep is off there, so only the group kill and the child's own ending remain."""
    import test_audit_children as children
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    tmp = tmp_path_factory.mktemp("threaded")
    (tmp / "watch.py").write_text(children.WATCH)
    names = ["a clean audit", "a hung forward at --timeout", "os._exit(0) in audit_spec", "SIGKILL in forward"]
    cases = []
    for i, name in enumerate(names):
        body, args = children.CASES[name]
        path = tmp / f"case{i}.py"
        path.write_text(children.PRELUDE.format(pids=str(tmp / f"pids{i}.txt")).lstrip("\n")
                        + __import__("textwrap").dedent(body))
        cases.append([name, ["audit", str(path), "--steps", "1", *args], str(tmp / f"pids{i}.txt")])
    (tmp / "warm.py").write_text("import torch, torchledger\ndef audit_spec():\n"
                                 "    return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))\n")
    harness = children.HARNESS.format(gone=children.GONE_S).replace(
        "for name, args, pids in cases:",
        "import threading\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "assert threading.active_count() == 2\nfor name, args, pids in cases:")
    (tmp / "harness.py").write_text(harness)
    results = tmp / "results.jsonl"
    done = subprocess.run([sys.executable, str(tmp / "harness.py"), str(tmp / "warm.py"), str(results),
                           json.dumps(cases)], capture_output=True, text=True, env=ENV, timeout=240)
    found = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())} if results.exists() else {}
    for name, _, pids in cases:
        found.setdefault(name, {"missing": f"harness exit {done.returncode}: {done.stderr[-2000:]}"})
        found[name]["noted"] = ([int(line.split()[0]) for line in open(pids).read().splitlines()]
                                if os.path.exists(pids) else [])
    return found


@pytest.mark.parametrize("name", ["a clean audit", "a hung forward at --timeout", "os._exit(0) in audit_spec"])
def test_a_threaded_parent_leaves_nothing_running(threaded_outcomes, name):
    """Was: from a threaded parent the `sleep` started with start_new_session=True and the
    double-fork setsid daemon outlived the audit (the parent's sweep runs from one thread only).
    Now the child is their subreaper and ends every descendant itself before it exits (a
    result sent, os._exit), and the parent ends them while the child still lives (--timeout)."""
    o = threaded_outcomes[name]
    assert "missing" not in o, o["missing"]
    assert o["started"] == 6, o                  # 2 workers, 1 Process, 2 sleeps, 1 daemon
    assert o["left"] == [], o["left"]


def test_a_threaded_parent_always_kills_the_childs_group(threaded_outcomes):
    """A child killed outright (SIGKILL) cannot end its descendants: from a threaded parent what
    left its group outlives it (the supervisor's Known limitations); its group never does."""
    o = threaded_outcomes["SIGKILL in forward"]
    assert "missing" not in o, o["missing"]
    assert o["started"] == 6, o
    # noted in order: 2 DataLoader workers, the Process and `sleep 300` (the child's group), then
    # `sleep 300` with start_new_session=True and the setsid daemon (out of it)
    group, escaped = o["noted"][:4], o["noted"][4:]
    left = [pid for pid, _, _ in o["left"]]
    assert not set(left) & set(group), o["left"]
    assert set(left) <= set(escaped), o["left"]
