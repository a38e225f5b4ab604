"""benchmarks/gpu_check.py: the laptop's prediction of a bundled example beside the same audit on
the real GPU. Without CUDA it checks nothing and says so (exit 2); its arithmetic and the record
fields it reads are checked here on the CPU, the whole check on a GPU (``-m cuda``)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
cuda = pytest.mark.cuda


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT)


def test_without_cuda_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    r = _run("--out", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu_check: no CUDA device (torch ")
    assert "nothing checked" in r.stderr and not os.listdir(tmp_path)


def _matmul(dtype, flops):
    return {"op": "aten.mm", "kind": "matmul", "shapes": [{"dtype": dtype, "flops": flops}]}


def test_rows_by_hand():
    g = _module()
    predicted = {"totals": {"peak_bytes": 1_000, "flops": {"total": 600}},
                 "predictions": {"step_time": {"seconds": 2.0, "mfu": 0.5}},
                 "ops": [_matmul("bf16", 300), _matmul("fp32", 100), {"kind": "elementwise"}]}
    measured = {"totals": {"peak_bytes": 1_250, "flops": {"total": 600}, "step_seconds": 2.5},
                "predictions": {"step_time": {"seconds": 1.8, "mfu": 0.55, "measured_seconds": 2.5}},
                "memory": {"cuda": [{"at": "start", "max_allocated_bytes": 1_500},
                                    {"at": "end", "max_allocated_bytes": 1_600}]},
                "ops": [_matmul("bf16", 400)]}
    rows = {name: (p, m) for name, p, m in g.compare(predicted, measured)}
    assert rows["peak bytes (the tracer's)"] == (1_000, 1_250)
    assert rows["peak bytes (the allocator's high-water mark)"] == (None, 1_600)
    assert rows["step seconds"] == (2.0, 2.5)
    # measured MFU: the same FLOPs and peak at the measured time: 0.55 x 1.8 / 2.5 = 0.396
    assert rows["MFU"][0] == 0.5 and abs(rows["MFU"][1] - 0.396) < 1e-12
    assert rows["model FLOPs per step"] == (600, 600)
    assert rows["share of matmul FLOPs in 16 bits"] == (0.75, 1.0)     # 300 of 400; 400 of 400
    text = g.table(g.compare(predicted, measured))
    assert "0.800" in text and "1,600" not in text                  # 1,000 / 1,250; bytes in GiB


def test_a_failing_audit_is_one_line(tmp_path):
    g = _module()
    with pytest.raises(g.CheckError, match=r"exited 2: .*no such file"):
        g.audit(os.path.join("examples", "no_such_model.py"), [], str(tmp_path / "x.json"))


@pytest.mark.slow
def test_the_fields_it_reads_exist_in_real_records(tmp_path):
    """The fake audit and a real (CPU) one of the same file, as the check runs them on a GPU:
    every quantity it compares is there (the CPU record has no allocator mark nor a measured
    prediction, which only a CUDA step makes)."""
    g = _module()
    flags = ["--steps", "2", "--precision", "bf16-mixed", "--gpu", "H100 SXM"]
    pred = g.audit(os.path.join("examples", "gpt2_tiny.py"), flags, str(tmp_path / "p.json"))
    real = g.audit(os.path.join("examples", "gpt2_tiny.py"), flags + ["--device", "cpu"], str(tmp_path / "m.json"))
    rows = {name: (p, m) for name, p, m in g.compare(pred, real)}
    assert rows["step seconds"][0] > 0 and rows["step seconds"][1] > 0
    assert 0 < rows["MFU"][0] < 1 and rows["MFU"][1] is None
    assert rows["peak bytes (the tracer's)"][0] > 0 and rows["peak bytes (the tracer's)"][1] > 0
    assert rows["model FLOPs per step"][0] == rows["model FLOPs per step"][1] > 0
    assert rows["share of matmul FLOPs in 16 bits"] == (1.0, 1.0)    # bf16-mixed: every matmul


@cuda
def test_the_check_on_a_gpu(tmp_path):
    r = _run(os.path.join("examples", "gpt2_tiny.py"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["quantity"]: row for row in json.load(open(tmp_path / "gpu-check.json"))["rows"]}
    assert rows["model FLOPs per step"]["predicted"] == rows["model FLOPs per step"]["measured"] > 0
    # --precision bf16-mixed on --device cuda autocasts on CUDA (autocast("cpu") left them fp32)
    assert rows["share of matmul FLOPs in 16 bits"]["measured"] == 1.0
    assert rows["step seconds"]["measured"] > 0 and 0 < rows["MFU"]["measured"] < 1
    assert rows["peak bytes (the allocator's high-water mark)"]["measured"] > 0
