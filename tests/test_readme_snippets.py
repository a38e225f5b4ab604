"""The integration snippets of docs/integrations.md run as written (each in a fresh process, in
a temporary folder), and give the figures the page quotes beside them."""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snippet(section: str) -> str:
    """The first ``python`` code block after the heading ``section`` of docs/integrations.md."""
    with open(os.path.join(ROOT, "docs", "integrations.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {section}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match, f"no python block under {section}"
    return match.group(1)


def run(code: str, cwd, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code],
                          cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_hf_trainer_snippet(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r = run(snippet("Hugging Face `Trainer`"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    records = sorted(glob.glob(str(tmp_path / "hf_out" / "torchledger" / "step_*.json")))
    assert [os.path.basename(p) for p in records] == ["step_000001.json", "step_000003.json"]
    for path in records:
        t = json.load(open(path))["totals"]
        # the page: 5,701,632 FLOPs, 32 tokens, 178,176 per token = 6N + 12LTd
        # (N = 28,672, L = 2, T = 8, d = 32): 6*28,672 + 12*2*8*32 = 172,032 + 6,144
        assert (t["flops"]["total"], t["tokens"]) == (5_701_632, 32)
        assert t["flops"]["total"] // t["tokens"] == 6 * 28_672 + 12 * 2 * 8 * 32 == 178_176
    assert "'torchledger/flops_per_token': 178176.0" in r.stdout


@pytest.mark.slow
def test_lightning_snippet(tmp_path):
    pytest.importorskip("lightning")
    r = run(snippet("Lightning"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "pl_out" / "lightning_logs" / "version_0" / "metrics.csv"))
    rows = [row for row in csv.DictReader(open(metrics)) if row.get("torchledger/flops")]
    # steps 0 and 2 traced; 73,728 FLOPs per token = 6 x 12,288 matmul weights (32x128 x 2 + 32x128)
    assert [row["step"] for row in rows] == ["0", "2"]
    assert all(float(row["torchledger/flops_per_token"]) == 6 * (3 * 32 * 128) == 73_728 for row in rows)
    assert glob.glob(str(tmp_path / "pl_out" / "lightning_logs" / "version_0" / "torchledger" / "*.json"))


@pytest.mark.slow
def test_pytest_snippet(tmp_path):
    (tmp_path / "test_model_budget.py").write_text(snippet("pytest"))
    r = run("", tmp_path, "-m", "pytest", "-q", "-p", "torchledger.pytest_plugin", "-p", "no:cacheprovider",
            "--torchledger-report", "ledger", "test_model_budget.py")
    if "already registered" in r.stdout + r.stderr:          # the installed entry point loaded it
        r = run("", tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "--torchledger-report", "ledger", "test_model_budget.py")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (record,) = glob.glob(str(tmp_path / "ledger" / "test_model_budget.py_*-0.json"))
    t = json.load(open(record))["totals"]
    # 10,485,760 per token: 6N (N = 2 x 512 x 2048 = 2,097,152) less 2 x 1,048,576, the first
    # layer's input gradient that is never made (x needs no gradient)
    assert t["flops"]["total"] // t["tokens"] == 6 * 2_097_152 - 2 * 512 * 2048 == 10_485_760
