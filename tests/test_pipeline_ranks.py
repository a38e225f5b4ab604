"""Real pipeline-parallel steps (issue 22, item 1 on real tensors): examples/pp_ranks.py under
torchrun (2 CPU ranks, gloo), PyTorch's own ``PipelineStage`` with ``Schedule1F1B`` and
``ScheduleGPipe``; each rank's records checked by hand: every send and receive of the
schedule recorded with its bytes, in the phase of the work it carries."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pp_ranks.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pp_records(tmp_path_factory):
    """OUT/{1f1b,gpipe}/step{0,1}/rank{0,1}.json."""
    out = tmp_path_factory.mktemp("pp")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", f"--rdzv-endpoint=localhost:{port}", EXAMPLE, str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in 90 s: {(e.stderr or '')[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def p2p(rec) -> dict:
    """(op, phase) -> [count, bytes sent, bytes received] of the record's collectives."""
    out = {}
    for c in rec["collectives"]:
        row = out.setdefault((c["op"], c["phase"]), [0, 0, 0])
        row[0] += c["count"]
        row[1] += c["bytes"]
        row[2] += c["bytes_received"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_stages_sends_and_receives_land_in_their_phase(pp_records, schedule):
    # 2 micro-batches of [4, 8] fp32 activations: 4*8*4 = 128 B each way per micro-batch
    mb = 4 * 8 * 4
    for step in (0, 1):
        recs = [json.loads((pp_records / schedule / f"step{step}" / f"rank{r}.json").read_text())
                for r in (0, 1)]
        got = [p2p(rec) for rec in recs]
        # stage 0 sends its activations in forward and receives their gradients in backward;
        # stage 1 the other way round
        assert {k: v for k, v in got[0].items() if k[1] != "other"} == \
            {("send", "forward"): [2, 2 * mb, 0], ("recv", "backward"): [2, 0, 2 * mb]}
        assert {k: v for k, v in got[1].items() if k[1] != "other"} == \
            {("recv", "forward"): [2, 0, 2 * mb], ("send", "backward"): [2, 2 * mb, 0]}
        for rec in recs:
            assert all(c["module"] == "" for c in rec["collectives"] if c["phase"] != "other")  # the stage
            assert rec["warnings"] == []
        assert recs[0]["totals"]["comm_bytes"]["forward"] == recs[1]["totals"]["comm_bytes"]["backward"] == 2 * mb
        assert recs[0]["totals"]["comm_bytes"]["backward"] == recs[1]["totals"]["comm_bytes"]["forward"] == 0
        # what one rank sends the other receives, phase by phase
        for phase in ("forward", "backward", "other"):
            assert got[0].get(("send", phase), [0, 0])[1] == got[1].get(("recv", phase), [0, 0, 0])[2]
            assert got[1].get(("send", phase), [0, 0])[1] == got[0].get(("recv", phase), [0, 0, 0])[2]
        if step == 1:        # the first step's set-up (vote, shape metadata) is not repeated
            assert all(k[1] != "other" for g in got for k in g)
            # the step is the stage's: forward 2 micro-batches x 2*4*8*8 = 1024 FLOPs per rank;
            # backward: the weight grads (1024), and on stage 1 its input grads too (1024)
            assert [r["totals"]["flops"]["forward"] for r in recs] == [1024, 1024]
            assert [r["totals"]["flops"]["backward"] for r in recs] == [1024, 2048]
        else:
            assert got[0][("send", "other")][0] == got[1][("recv", "other")][0] == 3


def test_the_stage_methods_are_wrapped_only_for_the_step():
    """The four methods that make a stage's P2POps are wrapped while a step is traced (the
    pipelining module imported), and put back after, even when the step raises."""
    import torch
    import torch.nn as nn
    from torch.distributed.pipelining.stage import _PipelineStageBase

    import torchledger
    names = ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops")
    before = [getattr(_PipelineStageBase, n) for n in names]
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with torchledger.trace(m):
            assert all(getattr(_PipelineStageBase, n).__wrapped__ is f for n, f in zip(names, before))
            m(torch.ones(1, 2)).sum().backward()
            raise RuntimeError("boom")
    assert [getattr(_PipelineStageBase, n) for n in names] == before
