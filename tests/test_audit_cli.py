"""`torchledger audit` and `torchledger report` through click's CliRunner."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
from click.testing import CliRunner

from torchledger.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run(*args, cwd=None):
    runner = CliRunner()
    if cwd is None:
        return runner.invoke(cli, list(args), catch_exceptions=False)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(cli, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)


def one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in result.output
    for n in needles:
        assert n in err, err
    return err


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


GOOD = """
    import torch, torchledger
    from torchledger.models import build_model

    def audit_spec():
        model = build_model("gpt2-tiny")
        idx = torch.randint(0, 512, (2, 16))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""


def test_audit_example_table():
    r = run("audit", os.path.join(EXAMPLES, "gpt2_tiny.py"), "--steps", "2")
    assert r.exit_code == 0, r.output
    assert "fake (cpu)" in r.stdout and "CPU flash attention" in r.stdout
    assert "blocks.0" in r.stdout


def test_audit_json_numbers(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    r = run("audit", path, "--format", "json", "--steps", "1")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["schema"] == "torchledger/1"
    t = d["totals"]
    N, D, L, T, dm = 131072, 32, 2, 16, 64
    assert t["tokens"] == D and t["matmul_params"] == N
    assert t["flops"]["total"] == 6 * N * D + 12 * L * T * dm * D
    assert d["predictions"]["flops_6nd_attention"] == t["flops"]["total"]
    assert d["meta"]["audit"]["device"] == "fake"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_audit_other_devices(tmp_path, device):
    path = write(tmp_path, "m.py", GOOD)
    r = run("audit", path, "--device", device, "--format", "json", "--steps", "1")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["flops"]["total"] == 6 * 131072 * 32 + 12 * 2 * 16 * 64 * 32


def test_output_is_written_atomically_with_inferred_format(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    out = tmp_path / "report.md"
    r = run("audit", path, "--steps", "1", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_text().lstrip().startswith("#") and r.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["m.py", "report.md"]


def test_leaky_example_fails_on_warning():
    path = os.path.join(EXAMPLES, "leaky_step.py")
    r = run("audit", path, "--device", "cpu", "--format", "json", "--fail-on", "warning")
    assert r.exit_code == 1
    rules = {f["rule"] for f in json.loads(r.stdout)["findings"]}
    assert {"TL-COPY-001", "TL-COPY-003", "TL-LEAK-002"} <= rules
    assert run("audit", path, "--device", "cpu", "--fail-on", "error").exit_code == 0


def test_budget_from_pyproject(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nmax_params = "100K"\n')
    r = run("audit", path, "--steps", "1", "--format", "json")
    assert r.exit_code == 1
    assert "TL-BUDGET-001" in {f["rule"] for f in json.loads(r.stdout)["findings"]}


def test_malformed_settings(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nmax_params = "lots"\n')
    one_line_error(run("audit", path), "max_params", "expected a count")


def test_baseline_growth_fails_with_module_diff(tmp_path):
    small = write(tmp_path, "small.py", GOOD)
    base = tmp_path / "base.json"
    assert run("audit", small, "--steps", "1", "--output", str(base)).exit_code == 0
    big = write(tmp_path, "big.py", GOOD.replace("(2, 16)", "(4, 16)"))
    r = run("audit", big, "--steps", "1", "--baseline", str(base), "--format", "json")
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert "TL-BASELINE-001" in {f["rule"] for f in d["findings"]}
    assert any(row.get("flops_delta") for row in d["meta"]["baseline_diff"])
    same = run("audit", small, "--steps", "1", "--baseline", str(base))
    assert same.exit_code == 0


def test_malformed_baseline(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    one_line_error(run("audit", path, "--baseline", str(bad)), "--baseline", "not a torchledger")


def test_report_renders_saved_record(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    saved = tmp_path / "a.json"
    run("audit", path, "--steps", "1", "--output", str(saved))
    r = run("report", str(saved), "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[0].startswith("name,")
    one_line_error(run("report", str(tmp_path / "missing.json")), "no such file")


BAD_CASES = {
    "missing": (None, ["no such file"]),
    "binary": (b"\x00\x01\x02", ["not a Python source file"]),
    "syntax": ("def audit_spec(:\n    pass\n", ["m.py:1", "syntax error"]),
    "no-entry": ("def build():\n    pass\n", ["no function 'audit_spec'", "build"]),
    "raises": ("def audit_spec():\n    raise RuntimeError('boom here')\n", ["m.py:2", "boom here"]),
    "not-a-spec": ("def audit_spec():\n    return 42\n", ["AuditSpec", "int"]),
    "rejected-inputs": (GOOD.replace("(2, 16)", "(2, 500)"), ["exceeds", "inputs"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_model_files(tmp_path, case):
    body, needles = BAD_CASES[case]
    path = tmp_path / "m.py"
    if isinstance(body, bytes):
        path.write_bytes(body)
    elif body is not None:
        path.write_text(textwrap.dedent(body))
    out = tmp_path / "out.json"
    one_line_error(run("audit", str(path), "--output", str(out)), *needles)
    assert not out.exists()


def test_fake_unsupported_op_suggests_other_devices(tmp_path):
    path = write(tmp_path, "m.py", """
        import torch, torchledger

        class DataDependent(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x):
                y = self.lin(x)
                return y[y > 0].sum()          # data-dependent shape

        def audit_spec():
            return torchledger.AuditSpec(DataDependent(), torch.randn(3, 4))
    """)
    err = one_line_error(run("audit", path), "cannot run on fake tensors")
    assert "--device meta" in err or "--device cpu" in err
    assert run("audit", path, "--device", "cpu", "--steps", "1").exit_code == 0


def test_unknown_entry_flag_and_device(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    one_line_error(run("audit", path, "--entry", "nope"), "no function 'nope'")
    assert run("audit", path, "--device", "tpu").exit_code == 2


def test_memory_snapshot_needs_cuda(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    out = tmp_path / "snap.pickle"
    one_line_error(run("audit", path, "--memory-snapshot", str(out)), "CUDA allocator data unavailable")
    assert not out.exists()


def test_allocator_unavailable_is_said_not_zeroed(tmp_path):
    path = write(tmp_path, "m.py", GOOD)
    r = run("audit", path, "--device", "cpu", "--steps", "1", "--format", "json")
    alloc = json.loads(r.stdout)["memory"]["allocator"]
    assert alloc["available"] is False and "unavailable" in alloc["reason"]
    assert "CUDA allocator: CUDA allocator data unavailable" in run("audit", path, "--steps", "1").stdout


def test_console_entry_exits_fast_but_runs_exit_handlers_and_flushes(tmp_path):
    """`python -m torchledger` leaves with os._exit (no interpreter teardown): the exit code,
    the whole report on stdout, the one-line error on stderr and the user's atexit handlers
    must all survive that."""
    import subprocess
    import sys
    marker = tmp_path / "atexit.txt"
    model = write(tmp_path, "m.py", f"""
        import atexit, torch, torchledger
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(4, 6), torch.randn(2, 4))
    """)
    r = subprocess.run([sys.executable, "-m", "torchledger", "audit", str(model), "--steps", "1",
                        "--format", "json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["flops"]["forward"] == 2 * 2 * 4 * 6   # 96: all of it arrived
    assert marker.read_text() == "ran"
    r = subprocess.run([sys.executable, "-m", "torchledger", "audit", str(tmp_path / "none.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr


DEVICELESS_COUNTER = """
    import torch, torchledger
    from torchledger.models import build_model

    class CountingSGD(torch.optim.SGD):
        # as torch 2.11/2.12's Adam: a step counter made with no device, read back with .item()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                st = self.state[p]
                st["n"] = st.get("n", torch.tensor(0.0)) + 1
                st["n"].item()
            return super().step(closure)

    def audit_spec():
        model = build_model("gpt2-tiny")
        idx = torch.randint(0, 512, (2, 16))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx},
                                     optimizer=lambda ps: CountingSGD(ps, lr=0.1))
"""


def test_meta_audit_optimizer_scalars_made_without_device(tmp_path):
    path = write(tmp_path, "m.py", DEVICELESS_COUNTER)
    r = run("audit", path, "--device", "meta", "--format", "json", "--steps", "2")
    assert r.exit_code == 0, r.output
    # gpt2-tiny, D = 2 x 16 = 32 tokens: 6ND = 6 x 131,072 matmul params x 32 = 25,165,824,
    # + attention 12 L T d D = 12 x 2 x 16 x 64 x 32 = 786,432 (dense)
    assert json.loads(r.stdout)["totals"]["flops"]["total"] == 25_165_824 + 786_432


def test_audit_gpu_fit_gates_ci():
    """llama2-7b in fp32 with AdamW holds 20 bytes/param at its optimizer step on a GPU (weights,
    gradients, two moments, and the foreach path's list of sqrt(v)): it cannot fit one 80 GB
    H100 (error, exit 1) and fits the 139.80 GiB of an H200 within 0.9 (info, exit 0)."""
    path = os.path.join(EXAMPLES, "llama2_7b.py")
    r = run("audit", path, "--steps", "1", "--gpu", "h100", "--format", "json")
    assert r.exit_code == 1, r.output
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "TL-MEM-002"]
    assert f["severity"] == "error" and f["expected"] == 79.18 * 2**30 and f["measured"] > 16 * 6_738_415_616
    r = run("audit", path, "--steps", "1", "--gpu", "h200", "--format", "json")
    assert r.exit_code == 0, r.output
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "TL-MEM-002"]
    # 20 x 6,738,415,616 = 134,768,312,320 B, and 17,552 B of the step's small tensors
    assert f["severity"] == "info" and 20 * 6_738_415_616 <= f["measured"] < 0.9 * 139.80 * 2**30
    one_line_error(run("audit", path, "--gpu", "z999"), "--gpu")


def test_python_api_example_runs_as_a_script():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "trace_step.py")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("torchledger step report: Transformer on cpu")
    assert "FLOPs: forward" in r.stdout


READS_A_VALUE = """
    import torch, torchledger

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if (x > 0).all():                    # reads a value: meta tensors have none
                x = x * 2
            return self.lin(x).sum()

    def audit_spec():
        return torchledger.AuditSpec(Gate(), torch.randn(2, 4))
"""

TRUNC_NORMAL_INIT = """
    import torch, torchledger

    def audit_spec():
        model = torch.nn.Linear(8, 8)
        torch.nn.init.trunc_normal_(model.weight, std=0.02)     # ViT-style init reads values
        return torchledger.AuditSpec(model, torch.randn(2, 8))
"""

CAST_AFTER_BUILD = """
    import torch, torchledger

    def audit_spec():
        model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        return torchledger.AuditSpec(model, torch.randn(2, 8, dtype=torch.bfloat16))
"""


def test_meta_step_that_reads_a_value_points_to_fake_and_cpu(tmp_path):
    path = write(tmp_path, "m.py", READS_A_VALUE)
    one_line_error(run("audit", path, "--device", "meta"), "meta tensors have no values",
                   "--device cpu", "m.py:10")
    one_line_error(run("audit", path), "fake tensors have no values", "--device cpu")
    # a simulated world runs on fake tensors only: --device cpu is refused there, so not offered
    err = one_line_error(run("audit", path, "--world-size", "2"), "fake tensors have no values",
                         "a simulated world", "torchrun")
    assert "--device cpu" not in err


DDP_UNUSED = """
    import torch, torchledger
    from torch.nn.parallel import DistributedDataParallel as DDP

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x).sum()

    def audit_spec():
        return torchledger.AuditSpec(M(), torch.randn(2, 8),
                                     parallelize=lambda m, mesh: DDP(m, FLAG=True))
"""


@pytest.mark.parametrize("flag", ["find_unused_parameters", "static_graph"])
def test_ddp_unused_parameter_search_on_fake_tensors_says_what_to_drop(tmp_path, flag):
    """DDP's reducer reads the all-reduced used-parameter map in backward: one line naming the
    flag to drop for the audit, not "try --device cpu" (refused in a simulated world)."""
    path = write(tmp_path, "ddp.py", DDP_UNUSED.replace("FLAG", flag))
    err = one_line_error(run("audit", path, "--world-size", "2"), f"DistributedDataParallel({flag}=True)",
                         f"audit the step without {flag}", "torchrun")
    assert "--device cpu" not in err
    assert run("audit", path, "--device", "cpu", "--steps", "1").exit_code == 0     # real values


def test_trunc_normal_init_builds_on_fake_tensors(tmp_path):
    import torch.nn.init as init
    before = init._no_grad_trunc_normal_
    path = write(tmp_path, "m.py", TRUNC_NORMAL_INIT)
    r = run("audit", path, "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["params"] == 8 * 8 + 8
    assert init._no_grad_trunc_normal_ is before                                # restored


def fake_conversion_fails(convert) -> bool:
    """Whether this torch refuses to convert a fake module's parameters in place (torch 2.13:
    "_apply(): Couldn't swap Linear.weight"): decided apart from the audit under test."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        try:
            convert(torch.nn.Conv2d(3, 8, 3))
        except RuntimeError as e:
            assert "Couldn't swap" in str(e), e
            return True
    return False


def test_cast_after_build_on_fake_says_what_to_do(tmp_path):
    import torch
    path = write(tmp_path, "m.py", CAST_AFTER_BUILD)
    r = run("audit", path, "--steps", "1", "--format", "json")
    if not fake_conversion_fails(lambda m: m.to(torch.bfloat16)):      # a torch that converts
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["totals"]["param_bytes"] == (8 * 8 + 8) * 2       # bf16
        return
    one_line_error(r, "model.to(dtype)", "set_default_dtype", "--device meta")


CHANNELS_LAST_MODEL = """
    import torch, torch.nn as nn, torchledger

    def audit_spec():
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 8 * 8, 4))
        model = model.to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
        return torchledger.AuditSpec(model, (x,), tokens=2)
"""


def test_channels_last_model_on_fake_gets_memory_format_advice(tmp_path):
    import torch
    path = write(tmp_path, "m.py", CHANNELS_LAST_MODEL)
    r = run("audit", path, "--steps", "1", "--format", "json", "--fail-on", "never")
    if not fake_conversion_fails(lambda m: m.to(memory_format=torch.channels_last)):
        # a torch that converts in place: the audit runs and counts what cpu counts
        cpu = run("audit", path, "--device", "cpu", "--steps", "1", "--format", "json", "--fail-on", "never")
        assert r.exit_code == 0 and cpu.exit_code == 0, r.output + cpu.output
        assert json.loads(r.stdout)["totals"]["flops"] == json.loads(cpu.stdout)["totals"]["flops"]
        return
    err = one_line_error(r, "memory_format", "channels_last inputs", "--device cpu")
    assert "set_default_dtype" not in err and "model.to(dtype)" not in err
    # what the hint says works: channels_last inputs alone on fake count what the converted
    # model does on cpu (--device meta does not: its kernels save less here)
    inputs_only = write(tmp_path, "inputs.py", CHANNELS_LAST_MODEL.replace(
        "model = model.to(memory_format=torch.channels_last)", "pass"))
    fake = run("audit", inputs_only, "--steps", "1", "--format", "json", "--fail-on", "never")
    cpu = run("audit", path, "--device", "cpu", "--steps", "1", "--format", "json", "--fail-on", "never")
    assert fake.exit_code == 0 and cpu.exit_code == 0, fake.output + cpu.output
    totals = [json.loads(x.stdout)["totals"] for x in (fake, cpu)]
    assert totals[0]["flops"]["total"] == totals[1]["flops"]["total"]
    assert totals[0]["activation_bytes"] == totals[1]["activation_bytes"]


# -- --output onto links, devices and FIFOs (write_atomic) ------------------------------------
RECORD = os.path.join(ROOT, "tests", "data", "gpt2-tiny", "record.json")
SNAPSHOT = os.path.join(ROOT, "tests", "data", "snapshots", "history.pickle")


def _char_device(tmp_path, name, minor):
    """A copy of /dev/null (minor 3) or /dev/full (minor 7) in tmp_path; skips when not root."""
    import stat
    path = tmp_path / name
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    except (PermissionError, AttributeError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e})")
    return path


@pytest.mark.parametrize("command", ["report", "snapshot"])
def test_output_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path, command):
    source = RECORD if command == "report" else SNAPSHOT
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("{}")
    link.symlink_to(target)
    r = run(command, source, "--format", "json", "--output", str(link))
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) != {}
    assert sorted(os.listdir(tmp_path)) == ["link.json", "target.json"]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")       # a link to a file not there yet: created
    assert run(command, source, "--format", "json", "--output", str(dangling)).exit_code == 0
    assert dangling.is_symlink() and json.loads((tmp_path / "made.json").read_text()) != {}


def test_output_to_a_character_device_writes_to_it_and_never_replaces_it(tmp_path):
    import stat
    null = _char_device(tmp_path, "mynull", 3)
    r = run("report", RECORD, "--format", "json", "--output", str(null))
    assert r.exit_code == 0, r.output
    assert stat.S_ISCHR(os.stat(null).st_mode)
    full = _char_device(tmp_path, "myfull", 7)
    one_line_error(run("report", RECORD, "--format", "json", "--output", str(full)),
                   f"--output {full}", "No space left on device")
    assert stat.S_ISCHR(os.stat(full).st_mode)
    link = tmp_path / "link"
    link.symlink_to(null)
    assert run("report", RECORD, "--output", str(link), "--format", "csv").exit_code == 0
    assert link.is_symlink() and stat.S_ISCHR(os.stat(null).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["link", "myfull", "mynull"]


def test_output_to_a_fifo_streams_into_it(tmp_path):
    import stat
    import threading
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []

    def reader():
        with open(fifo, "rb") as f:           # blocks until the writer opens it
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    r = run("report", RECORD, "--format", "json", "--output", str(fifo))
    t.join(timeout=30)
    assert r.exit_code == 0, r.output
    assert got and json.loads(got[0])["schema"] == "torchledger/1"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_output_to_a_directory_is_one_line(tmp_path):
    one_line_error(run("report", RECORD, "--format", "json", "--output", str(tmp_path)), "--output")


# -- what the spec's callables return or do ---------------------------------------------------
@pytest.mark.parametrize("returned, shown", [("5", "int (5)"), ("None", "NoneType (None)"),
                                             ("list(p)", "list")])
def test_optimizer_factory_returning_a_non_optimizer_is_one_line(tmp_path, returned, shown):
    path = write(tmp_path, "m.py", f"""
        import torch, torchledger

        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(4, 4), torch.randn(2, 4),
                                         optimizer=lambda p: {returned})
    """)
    out = tmp_path / "out.json"
    one_line_error(run("audit", path, "--steps", "1", "--output", str(out)),
                   "m.py:6", f"AuditSpec.optimizer(params) returned {shown}", "torch.optim.Optimizer")
    assert not out.exists()


def test_duck_typed_optimizer_is_accepted(tmp_path):
    path = write(tmp_path, "m.py", """
        import torch, torchledger

        class Plain:
            def __init__(self, params):
                self.param_groups = [{"params": list(params), "lr": 0.1}]
                self.state = {}

            @torch.no_grad()
            def step(self):
                for p in self.param_groups[0]["params"]:
                    p -= 0.1 * p.grad

            def zero_grad(self, set_to_none=True):
                for p in self.param_groups[0]["params"]:
                    p.grad = None

        def audit_spec():
            return torchledger.AuditSpec(torch.nn.Linear(4, 4), torch.randn(2, 4), optimizer=Plain)
    """)
    r = run("audit", path, "--steps", "1", "--device", "cpu", "--fail-on", "never")
    assert r.exit_code == 0, r.output


EXITS = {
    "import": ("import sys\nsys.exit(3)\n", "importing the model file called sys.exit(3)"),
    "spec": ("import sys\ndef audit_spec():\n    sys.exit(3)\n", "audit_spec() called sys.exit(3)"),
    "message": ("import sys\ndef audit_spec():\n    sys.exit('no data')\n",
                "audit_spec() called sys.exit('no data')"),
    "optimizer": ("import sys, torch, torchledger\n"
                  "def audit_spec():\n"
                  "    return torchledger.AuditSpec(torch.nn.Linear(4, 4), torch.randn(2, 4),\n"
                  "                                 optimizer=lambda p: sys.exit(4))\n",
                  "making the optimizer called sys.exit(4)"),
    "forward": ("import sys, torch, torchledger\n"
                "class M(torch.nn.Linear):\n"
                "    def forward(self, x):\n"
                "        sys.exit(5)\n"
                "def audit_spec():\n"
                "    return torchledger.AuditSpec(M(4, 4), torch.randn(2, 4))\n",
                "m.py:4: the training step called sys.exit(5)"),
    "step": ("import sys, torch, torchledger\n"
             "def audit_spec():\n"
             "    return torchledger.AuditSpec(torch.nn.Linear(4, 4), torch.randn(2, 4),\n"
             "                                 step=lambda m, x, o: sys.exit())\n",
             "the training step called sys.exit()"),
}


@pytest.mark.parametrize("case", sorted(EXITS))
@pytest.mark.parametrize("device", ["fake", "cpu"])
def test_sys_exit_in_the_model_file_is_one_line_exit_2(tmp_path, case, device):
    body, needle = EXITS[case]
    path = tmp_path / "m.py"
    path.write_text(body)
    out = tmp_path / "out.json"
    one_line_error(run("audit", str(path), "--steps", "1", "--device", device, "--output", str(out)),
                   needle)
    assert not out.exists()


SHAPE_MISMATCH = """
    import torch, torchledger

    def audit_spec():
        return torchledger.AuditSpec(torch.nn.Linear(4, 4), torch.randn(2, 5))
"""


def test_fake_shape_error_prints_only_the_one_line(tmp_path):
    """torch's fake kernel logs its own traceback (logger torch._subclasses.fake_tensor,
    "failed while attempting to run meta for aten.mm.default") before re-raising; the audit
    silences it, so stderr is the one line."""
    import subprocess
    import sys
    model = write(tmp_path, "m.py", SHAPE_MISMATCH)
    r = subprocess.run([sys.executable, "-m", "torchledger", "audit", model, "--steps", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("torchledger: error: ") and "same reduction dim" in r.stderr


def test_torch_loggers_are_quiet_during_the_audit_and_restored_after(tmp_path):
    import logging

    from torchledger.audit.loading import TORCH_LOGGERS
    from torchledger.audit.engine import run_audit
    from torchledger.audit.spec import AuditError
    import torch._subclasses.fake_tensor  # noqa: F401
    model = write(tmp_path, "m.py", SHAPE_MISMATCH)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    before = {name: logging.getLogger(name).level for name in TORCH_LOGGERS}
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch()
    fake_log.addHandler(handler)
    try:
        with pytest.raises(AuditError, match="same reduction dim"):
            run_audit(model, steps=1)
        assert seen == []
        assert {name: logging.getLogger(name).level for name in TORCH_LOGGERS} == before
        with pytest.raises(AuditError):
            run_audit(model, steps=1, torch_logs=True)      # --debug: torch's log is shown
        assert any("failed while attempting to run meta" in m for m in seen), seen
    finally:
        fake_log.removeHandler(handler)


@pytest.mark.parametrize("body, missing", [
    ({"schema": "torchledger/1"}, "no totals"),
    ({"schema": "torchledger/1", "totals": {}}, "no totals"),
    ({"schema": "torchledger/1", "totals": {"flops": {"total": 5}, "params": 3}},
     "no totals.peak_bytes, totals.activation_bytes"),
    ({"schema": "torchledger/1", "totals": {"flops": {"forward": 1}, "params": 3, "peak_bytes": 1}},
     "no totals.flops.total, totals.activation_bytes"),
])
def test_incomplete_baseline_is_bad_input_not_a_passing_gate(tmp_path, body, missing):
    path = write(tmp_path, "m.py", GOOD)
    base = tmp_path / "base.json"
    base.write_text(json.dumps(body))
    out = tmp_path / "out.json"
    one_line_error(run("audit", path, "--steps", "1", "--baseline", str(base), "--output", str(out)),
                   f"--baseline {base}", "incomplete torchledger record", missing)
    assert not out.exists()


def test_report_of_a_record_without_totals_is_bad_input(tmp_path):
    rec = tmp_path / "r.json"
    rec.write_text('{"schema": "torchledger/1"}')
    one_line_error(run("report", str(rec)), "incomplete torchledger record", "no totals")
    full = json.load(open(RECORD))
    del full["totals"]["flops"]["total"]
    rec.write_text(json.dumps(full))
    one_line_error(run("report", str(rec)), "no totals.flops.total")
    assert run("report", os.path.join(ROOT, "tests", "data", "empty", "record.json")).exit_code == 0


def test_sarif_of_a_cpu_audit_locates_every_result_and_keeps_its_rules(tmp_path):
    """GitHub code scanning rejects a result without a physical location; rules must not
    change from run to run (TL-MFU-001's message carries this run's measured FLOP/s)."""
    write(tmp_path, "m.py", GOOD)
    logs = []
    for _ in range(2):
        r = run("audit", "m.py", "--device", "cpu", "--steps", "1", "--format", "sarif",
                "--fail-on", "never", cwd=str(tmp_path))     # MFU against the measured peak
        assert r.exit_code == 0, r.output
        logs.append(json.loads(r.stdout))
    run0 = logs[0]["runs"][0]
    assert "TL-MFU-001" in [res["ruleId"] for res in run0["results"]]
    spec_line = textwrap.dedent(GOOD).splitlines().index("def audit_spec():") + 1
    for res in run0["results"]:
        physical = res["locations"][0]["physicalLocation"]
        assert physical["artifactLocation"]["uri"] and physical["region"]["startLine"] >= 1, res
        assert not physical["artifactLocation"]["uri"].startswith("..")
        if res["ruleId"] == "TL-MFU-001":
            assert physical == {"artifactLocation": {"uri": "m.py"}, "region": {"startLine": spec_line}}
    assert "invocations" not in run0
    assert run0["tool"]["driver"]["rules"] == logs[1]["runs"][0]["tool"]["driver"]["rules"]
    assert all(res["message"]["text"] != rule["shortDescription"]["text"]
               for res in run0["results"] for rule in run0["tool"]["driver"]["rules"])


def test_readme_states_each_commands_fail_on_default(tmp_path):
    """docs/audit.md's exit-code sentence names the default of every command that has --fail-on."""
    text = " ".join(open(os.path.join(ROOT, "docs", "audit.md"), encoding="utf-8").read().split())
    sentence = text[text.index("Exit codes everywhere"):].split(". ")[0]
    write(tmp_path, "warn.py", "import torch\nx = torch.load('a.pt', weights_only=False)\n")  # a warning only
    assert run("lint", str(tmp_path / "warn.py")).exit_code == 1              # lint fails on it
    assert "`warning` for `lint`" in sentence and "default `error` for `audit`" in sentence
