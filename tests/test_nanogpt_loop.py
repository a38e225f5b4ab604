"""A third-party-style model file (examples/nanogpt_loop.py: a small GPT returning
``(logits, loss)``, AdamW, gradient accumulation, clipping, an eval forward, torch.compile)
under ``torchledger.Ledger`` and ``torchledger audit``."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from click.testing import CliRunner
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from torchledger.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "nanogpt_loop.py")


@pytest.fixture
def ng():
    spec = importlib.util.spec_from_file_location("nanogpt_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_loop"] = module      # its dataclass looks itself up there
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny matrices: threads only contend on a shared machine
    torch._dynamo.reset()
    yield module
    torch._dynamo.reset()
    torch.set_num_threads(threads)
    sys.modules.pop("nanogpt_loop", None)


def _run(ng, ledger_every):
    torch._dynamo.reset()
    counters.clear()
    cnt, frames = CompileCounter(), []
    losses, ledger, _ = ng.train(20, ledger_every=ledger_every, backend=cnt,
                                 on_step=lambda i: frames.append(cnt.frame_count))
    return losses, ledger, frames, dict(counters["stats"])


def test_twenty_steps_under_ledger_same_losses_compiled_and_no_false_finding(ng):
    plain, _, frames_plain, stats_plain = _run(ng, None)
    traced, ledger, frames, stats = _run(ng, 4)           # steps 0, 4, 8, 12, 16 traced
    assert traced == plain                                 # bitwise: the tracer changes no number
    assert len(ledger.records) == 5
    # dynamo's own counts: the same graphs compiled as without the Ledger (eval and train
    # mode), none recompiled for the trace; step 1, the first untraced one, compiled the
    # train-mode graph that the traced step 0 ran eagerly
    assert stats == stats_plain and stats["unique_graphs"] == 2
    assert frames[-1] == frames_plain[-1] == 2 and frames[0] == 1 and frames[1] == 2
    assert not counters["recompiles"]
    rec = ledger.records[-1]
    assert rec.meta["compiled"]["modules"] == ["(root)"] and rec.meta["model"] == "GPT"
    assert [f.rule for f in ledger.findings() if f.severity != "info"] == []
    # 2 micro-batches of 4 x 32 tokens: 6 x N x D plus attention, all in one step
    assert rec.totals["tokens"] == 2 * 4 * 32


def test_audit_json_on_stdout_uses_output_1(ng):
    r = CliRunner().invoke(cli, ["audit", EXAMPLE, "--format", "json", "--steps", "1"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)                            # the model's print went to stderr
    assert "number of parameters" in r.stderr
    assert data["meta"]["audit"]["loss"] == "output[1]"
    assert [f["rule"] for f in data["findings"] if f["severity"] != "info"] == []
