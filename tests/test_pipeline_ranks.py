"""Real pipeline-parallel steps: examples/pp_ranks.py under
torchrun (2 CPU ranks, gloo), PyTorch's own ``PipelineStage`` with ``Schedule1F1B``,
``ScheduleGPipe`` and ``ScheduleInterleaved1F1B`` (2 stages per rank); each rank's records checked by hand: every send and receive of the
schedule recorded with its bytes, in the phase of the work it carries."""
from __future__ import annotations

import json
import os

import pytest

from torchledger.tracer.collectives import PIPELINE_SETUP_WARNING
from conftest import run_torchrun  # noqa: E402  (the shared torchrun launcher)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pp_ranks.py")


@pytest.fixture(scope="module")
def pp_records(tmp_path_factory):
    """OUT/{1f1b,gpipe,interleaved}/step{0,1}/rank{0,1}.json."""
    out = tmp_path_factory.mktemp("pp")
    run_torchrun(EXAMPLE, out)
    return out


def p2p(rec) -> dict:
    """(op, phase, module) -> [count, bytes sent, bytes received] of the record's collectives."""
    out = {}
    for c in rec["collectives"]:
        row = out.setdefault((c["op"], c["phase"], c["module"]), [0, 0, 0])
        row[0] += c["count"]
        row[1] += c["bytes"]
        row[2] += c["bytes_received"]
    return out


def expected(rank: int, world: int, chunks: int, mb: int, m: int) -> dict:
    """By hand: stage s of S = chunks x world (rank r holds r, r + world, ...) receives its
    activations in forward unless first, sends them unless last; in backward it receives their
    gradients unless last and sends its inputs' unless first; m micro-batches of mb bytes each.
    The module: the stage's own (the traced model itself, or its ModuleList entry)."""
    out, S = {}, chunks * world
    for j, s in enumerate(range(rank, S, world)):
        mod = "" if chunks == 1 else str(j)
        if s > 0:
            out[("recv", "forward", mod)] = [m, 0, m * mb]
            out[("send", "backward", mod)] = [m, m * mb, 0]
        if s < S - 1:
            out[("send", "forward", mod)] = [m, m * mb, 0]
            out[("recv", "backward", mod)] = [m, 0, m * mb]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_a_stages_sends_and_receives_land_in_their_phase(pp_records, schedule):
    # 2 micro-batches of [4, 8] fp32 activations: 4*8*4 = 128 B each way per micro-batch
    mb, m, chunks = 4 * 8 * 4, 2, 2 if schedule == "interleaved" else 1
    for step in (0, 1):
        recs = [json.loads((pp_records / schedule / f"step{step}" / f"rank{r}.json").read_text())
                for r in (0, 1)]
        got = [p2p(rec) for rec in recs]
        for r in (0, 1):
            assert {k: v for k, v in got[r].items() if k[1] != "other"} == expected(r, 2, chunks, mb, m)
            # the first step runs the stages' set-up, and its record says so
            assert recs[r]["warnings"] == ([PIPELINE_SETUP_WARNING] if step == 0 else [])
            comm = recs[r]["totals"]["comm_bytes"]
            for phase in ("forward", "backward"):     # totals: the bytes sent, phase by phase
                assert comm[phase] == sum(v[1] for k, v in expected(r, 2, chunks, mb, m).items()
                                          if k[1] == phase)
        # what one rank sends the other receives, phase by phase (the set-up's "other" too)
        for phase in ("forward", "backward", "other"):
            def total(g, op, i):
                return sum(v[i] for k, v in g.items() if k[0] == op and k[1] == phase)
            assert total(got[0], "send", 1) == total(got[1], "recv", 2)
            assert total(got[1], "send", 1) == total(got[0], "recv", 2)
        if step == 1:        # the first step's set-up (vote, shape metadata) is not repeated
            assert all(k[1] != "other" for g in got for k in g)
            # the step is the stage's: forward m x 2*4*8*8 = 1024 FLOPs per stage; backward
            # the weight grads (1024), and the input grads (1024) on every stage but the first
            fwd = [r["totals"]["flops"]["forward"] for r in recs]
            bwd = [r["totals"]["flops"]["backward"] for r in recs]
            if chunks == 1:
                assert (fwd, bwd) == ([1024, 1024], [1024, 2048])
            else:            # rank 0: stages 0 and 2, rank 1: stages 1 and 3
                assert (fwd, bwd) == ([2048, 2048], [1024 + 2048, 2048 + 2048])
        else:
            assert any(k[1] == "other" for k in got[0])
            # the set-up's metadata inference: each stage's forward once more, on one [4, 8]
            # micro-batch (2*4*8*8 = 512 FLOPs, on meta tensors), counted and warned about
            later = [json.loads((pp_records / schedule / "step1" / f"rank{r}.json").read_text())
                     for r in (0, 1)]
            assert [a["totals"]["flops"]["forward"] - b["totals"]["flops"]["forward"]
                    for a, b in zip(recs, later)] == [512 * chunks] * 2


def test_the_stage_methods_are_wrapped_only_for_the_step():
    """The four methods that make a stage's P2POps, and its two set-up methods, are wrapped
    while a step is traced (the pipelining module imported), and put back after, even when the
    step raises."""
    import torch
    import torch.nn as nn
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import torchledger
    from torch.distributed.pipelining.stage import PipelineStage
    names = ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops")
    before = [getattr(_PipelineStageBase, n) for n in names]
    setup = ("_forward_metadata_inference", "_backward_metadata_inference")
    before_setup = [PipelineStage.__dict__[n] for n in setup]
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with torchledger.trace(m):
            assert all(getattr(_PipelineStageBase, n).__wrapped__ is f for n, f in zip(names, before))
            assert all(PipelineStage.__dict__[n].__wrapped__ is f for n, f in zip(setup, before_setup))
            m(torch.ones(1, 2)).sum().backward()
            raise RuntimeError("boom")
    assert [getattr(_PipelineStageBase, n) for n in names] == before
    assert [PipelineStage.__dict__[n] for n in setup] == before_setup
