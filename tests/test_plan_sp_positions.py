"""Sequence parallelism for decoders with learned positions (GPT-2/3 shaped): the standard plan
splits the position table like the token table, and a real two-rank run computes the loss and
the gradients the whole model does."""
from __future__ import annotations

import json
import os

import pytest

from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_tp_sp_with_learned_positions_matches_the_whole_model(tmp_path):
    run_torchrun(os.path.join(HERE, "_tp_sp_positions.py"), tmp_path, timeout=120)
    with open(tmp_path / "result.json") as f:
        r = json.load(f)
    whole, parallel = r["loss"]
    assert parallel == pytest.approx(whole, rel=1e-5)
    for name, err in r["grad_err"].items():
        assert err < 1e-5, (name, err)
    assert any("sequence parallel" in n and "learned positions" in n for n in r["notes"])


def test_learned_positions_shard_the_sequence_between_blocks(tmp_path):
    """gpt2-tiny (learned positions) at tp=2 on the fake world: sequence parallel now, so the
    blocks' norms see T/2 positions: a reduce-scatter in forward (before: all-reduces only)."""
    from torchledger.audit import run_audit
    from torchledger.analyzers.compare_layout import sequence_parallel
    root = os.path.dirname(HERE)
    rec = run_audit(os.path.join(root, "examples", "gpt2_tiny.py"), world_size=2, mesh="tp=2", steps=1).record
    assert sequence_parallel(rec)
    assert any("learned positions" in n for n in rec.meta["audit"]["plan"])
