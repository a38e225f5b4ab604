"""Collectives in the record: every op kind's bytes by hand, on PyTorch's fake process group
(real CPU tensors; the group communicates nothing, the tracer sees the ops as on NCCL/gloo).

Bytes (tracer/collectives.py): ``bytes`` is what this rank sends (all-reduce: the buffer;
all-gather: the local shard; reduce-scatter: the full input; send: the tensor; recv: 0),
``algo_bytes`` NCCL-tests' size, ``bus_bytes`` = algo x 2(n-1)/n (all-reduce), x (n-1)/n
(all-gather, reduce-scatter, all-to-all), x 1 (the rest).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import torchledger
from torchledger import StepRecord
from torchledger.formulas.comm import comm_per_step, fsdp_padded_bytes
from torchledger.record.schema import RecordError

N = 4


def _traced(fn):
    model = torch.nn.Linear(2, 2)
    with torchledger.trace(model) as t:
        fn()
    return t.record


def _only(rec, op):
    rows = [c for c in rec.collectives if c["op"] == op]
    assert len(rows) == 1, rec.collectives
    return rows[0]


def test_all_reduce_by_hand(fake_pg):
    x = torch.ones(1024)                                   # 1,024 fp32 = 4,096 B
    rec = _traced(lambda: dist.all_reduce(x))
    c = _only(rec, "all_reduce")
    assert (c["bytes"], c["bytes_received"], c["algo_bytes"]) == (4096, 4096, 4096)
    assert c["bus_bytes"] == 6144                          # 4096 * 2*(4-1)/4
    assert (c["group_size"], c["count"], c["phase"]) == (N, 1, "other")
    assert c["location"].endswith(f"test_collectives.py:{test_all_reduce_by_hand.__code__.co_firstlineno + 2}")
    assert rec.totals["comm_bytes"] == {"forward": 0, "backward": 0, "optimizer": 0, "other": 4096,
                                        "total": 4096}
    assert rec.totals["world_size"] == N and rec.totals["rank"] == 0
    # never FLOPs, never an uncounted op, never a copy
    assert rec.totals["flops"]["total"] == 0 and rec.totals["flops"]["other"] == 0
    assert rec.uncounted_ops == [] and rec.copies == []


def test_each_op_kind_by_hand(fake_pg):
    def step():
        shard, full = torch.ones(256), torch.empty(1024)   # 1 KiB shard, 4 KiB gathered
        dist.all_gather_into_tensor(full, shard)
        out = torch.empty(256)
        dist.reduce_scatter_tensor(out, torch.ones(1024))
        dist.broadcast(torch.ones(1024), src=0)
        dist.all_to_all_single(torch.empty(1024), torch.ones(1024))
        dist.all_gather([torch.empty(256) for _ in range(N)], shard)     # list form: same bytes
    rec = _traced(step)
    by = {}
    for c in rec.collectives:
        row = by.setdefault(c["op"], [0, 0, 0, 0, 0])
        for i, k in enumerate(("bytes", "bytes_received", "algo_bytes", "bus_bytes", "count")):
            row[i] += c[k]
    # all-gather (x2): sends its 1,024 B shard, receives 4,096, algo 4,096, bus 4096*3/4 = 3072
    assert by["all_gather"] == [2 * 1024, 2 * 4096, 2 * 4096, 2 * 3072, 2]
    # reduce-scatter: sends the full 4,096 B input, receives its 1,024 B shard, bus 4096*3/4
    assert by["reduce_scatter"] == [4096, 1024, 4096, 3072, 1]
    assert by["broadcast"] == [4096, 4096, 4096, 4096, 1]          # factor 1
    assert by["all_to_all"] == [4096, 4096, 4096, 3072, 1]         # (n-1)/n
    assert rec.totals["comm_bytes"]["total"] == 2 * 1024 + 4096 * 3
    assert rec.uncounted_ops == [] and rec.copies == []


def test_functional_and_coalesced_forms(fake_pg):
    import torch.distributed._functional_collectives as fc
    name = fake_pg.group_name

    def step():
        a = fc.all_reduce(torch.ones(1024), "sum", fake_pg)        # _c10d_functional.all_reduce
        b = fc.all_gather_tensor(torch.ones(256), 0, fake_pg)      # + wait_tensor
        outs = torch.ops._c10d_functional.all_reduce_coalesced([torch.ones(128), torch.ones(384)], "sum", name)
        for o in outs:
            torch.ops._c10d_functional.wait_tensor(o)
        rs = torch.ops._c10d_functional.reduce_scatter_tensor(torch.ones(1024), "sum", N, name)
        torch.ops._c10d_functional.wait_tensor(rs)
        return a + 1, b + 1
    with pytest.warns(FutureWarning):                              # all_gather_tensor's deprecation
        rec = _traced(step)
    ar = [c for c in rec.collectives if c["op"] == "all_reduce"]
    assert sorted(c["bytes"] for c in ar) == [2048, 4096]          # (128 + 384) * 4 = 2048
    assert sum(c["bus_bytes"] for c in ar) == (4096 + 2048) * 2 * 3 // 4
    ag = _only(rec, "all_gather")
    assert (ag["bytes"], ag["bytes_received"], ag["group_size"]) == (1024, 4096, N)
    assert not ag["location"].startswith(("<", "/")) and "typing_extensions" not in ag["location"]
    rs = _only(rec, "reduce_scatter")
    assert (rs["bytes"], rs["bytes_received"], rs["bus_bytes"]) == (4096, 1024, 3072)
    assert rec.uncounted_ops == []       # wait_tensor and the autograd wrapper are not ops of the step


def test_send_recv_by_hand(fake_pg):
    def step():
        dist.send(torch.ones(100), dst=1)                          # 400 B out
        dist.recv(torch.empty(50), src=1)                          # 200 B in
    rec = _traced(step)
    s, r = _only(rec, "send"), _only(rec, "recv")
    assert (s["bytes"], s["bytes_received"], s["bus_bytes"]) == (400, 0, 400)
    assert (r["bytes"], r["bytes_received"], r["bus_bytes"]) == (0, 200, 200)
    assert rec.totals["comm_bytes"]["total"] == 400


def test_record_round_trip_and_schema(fake_pg):
    rec = _traced(lambda: dist.all_reduce(torch.ones(1024)))
    back = StepRecord.from_json(rec.to_json())
    assert back.collectives == rec.collectives and back.totals["comm_bytes"] == rec.totals["comm_bytes"]
    d = json.loads(rec.to_json())
    d["collectives"][0]["bytes"] = -1
    with pytest.raises(RecordError, match=r"collectives\[0\]\.bytes"):
        StepRecord.from_dict(d)
    for key, bad in (("comm_bytes", 5), ("world_size", 0), ("rank", -1), ("mesh", [8, 0])):
        d = json.loads(rec.to_json())
        d["totals"][key] = bad
        with pytest.raises(RecordError, match=f"totals.{key}"):
            StepRecord.from_dict(d)


def test_single_process_record_is_rank_0_of_1_with_no_collectives():
    assert not dist.is_initialized()
    model = torch.nn.Linear(4, 4)
    with torchledger.trace(model) as t:
        model(torch.ones(2, 4)).sum().backward()
    d = t.record.to_dict()
    assert "collectives" not in d                        # written only when there are some
    assert d["totals"]["comm_bytes"] == {"forward": 0, "backward": 0, "optimizer": 0, "other": 0, "total": 0}
    assert (d["totals"]["rank"], d["totals"]["world_size"], d["totals"]["mesh"]) == (0, 1, None)
    assert "collectives" not in t.report()               # no section in a single-process report
    assert d["memory"]["categories"] == ["parameters", "buffers", "gradients", "optimizer_state",
                                         "activations", "temporaries"]
    assert StepRecord.from_dict(d).collectives == []     # an old record loads with none


def test_closed_forms_by_hand():
    ddp = comm_per_step(4096, gpus=4, strategy="ddp")
    assert (ddp.total, ddp.algo_bytes, ddp.bus_bytes) == (4096, 4096, 6144)   # 4096 * 2*3/4
    z3 = comm_per_step(8000, gpus=8, strategy="zero3")
    # all-gather 8000/8 = 1000 sent twice (forward, backward), reduce-scatter the full 8000
    assert z3.sent == {"forward": 1000, "backward": 9000, "optimizer": 0, "total": 10000}
    assert z3.bus_bytes == 3 * 8000 * 7 // 8                          # the ZeRO paper's 1.5 x DDP's 2
    assert comm_per_step(8000, gpus=8, strategy="zero3", reshard_after_forward=False).sent["backward"] == 8000
    z1 = comm_per_step(8000, gpus=8, strategy="zero1")
    assert z1.sent == {"forward": 0, "backward": 8000, "optimizer": 1000, "total": 9000}
    assert z1.bus_bytes == ddp_bus(8000, 8)                          # same volume as DDP
    assert fsdp_padded_bytes([(130, 64), (130,), ()], 4, 8) == (17 * 64 + 17 + 1) * 8 * 4
    with pytest.raises(ValueError, match="unknown strategy"):
        comm_per_step(1, gpus=2, strategy="zero4")


def ddp_bus(g, n):
    return g * 2 * (n - 1) // n


def test_a_raising_distributed_step_leaves_nothing_installed(fake_pg):
    """The storage-resize patch of a distributed step goes with everything else (leak guard),
    and the user's exception comes out as it was."""
    original = torch.UntypedStorage.resize_
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ZeroDivisionError):
        with torchledger.trace(model) as t:
            assert torch.UntypedStorage.resize_ is not original      # installed: a process group is up
            dist.all_reduce(torch.ones(8))
            1 / 0
    assert torch.UntypedStorage.resize_ is original
    assert t.record.totals["comm_bytes"]["total"] == 32                # 8 fp32 all-reduced before it raised
