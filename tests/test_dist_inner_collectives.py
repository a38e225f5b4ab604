"""Collectives a DTensor issues inside an op (sharding propagation redistributing an input,
foreach optimizer ops on Partial gradients) are recorded, and agree with PyTorch's
CommDebugMode op for op. World size 4 on the fake process group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchledger

WS = 4


@pytest.fixture
def mesh4():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WS)
    try:
        yield init_device_mesh("cpu", (WS,))
    finally:
        dist.destroy_process_group()


_PLAIN = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "scatter_": "scatter", "allreduce_": "all_reduce"}


def _comm_debug_counts(fn) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as comm:
        fn()
    out: dict = {}
    for op, n in comm.get_comm_counts().items():
        name = _PLAIN[str(op).split(".")[-1]]
        out[name] = out.get(name, 0) + n
    return out


def _ours(rec) -> dict:
    out: dict = {}
    for c in rec.collectives:
        out[c["op"]] = out.get(c["op"], 0) + c["count"]
    return out


def test_matmul_of_two_row_sharded_dtensors(mesh4):
    from torch.distributed.tensor import Shard, distribute_tensor
    a = distribute_tensor(torch.randn(8, 8), mesh4, [Shard(0)])
    b = distribute_tensor(torch.randn(8, 8), mesh4, [Shard(0)])
    theirs = _comm_debug_counts(lambda: torch.mm(a, b))
    with torchledger.trace(torch.nn.Linear(2, 2)) as t:
        torch.mm(a, b)
    assert _ours(t.record) == theirs == {"all_gather": 1}
    # sharding propagation gathers b (8 x 8 fp32 = 256 B): this rank sends its 2 rows, 64 B,
    # and receives all 256; bus (n-1)/n x 256 = 192
    [c] = t.record.collectives
    assert (c["bytes"], c["bytes_received"], c["bus_bytes"], c["group_size"]) == (64, 256, 192, WS)
    assert t.record.totals["comm_bytes"]["total"] == 64


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def test_tp_sp_adamw_all_reduces_partial_norm_grads(mesh4):
    """Sequence parallel LayerNorms: their weight and bias gradients are Partial DTensors;
    AdamW's foreach ops redistribute them inside each op (lerp of exp_avg, mul and addcmul of
    exp_avg_sq: 3 all-reduces per gradient), in the optimizer phase."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    for block in model:
        parallelize_module(block, mesh4, {"norm": SequenceParallel(),
                                          "up": ColwiseParallel(input_layouts=Shard(1)),
                                          "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(2, 8, 16)

    def step():
        model(distribute_tensor(x, mesh4, [Shard(1)])).to_local().sum().backward()
        opt.step()
        opt.zero_grad()
    step()                                        # AdamW's state exists from here on
    theirs = _comm_debug_counts(step)
    with torchledger.trace(model, optimizer=opt) as t:
        step()
    ours = _ours(t.record)
    assert ours == theirs
    opt_rows = [c for c in t.record.collectives if c["phase"] == "optimizer"]
    assert {c["op"] for c in opt_rows} == {"all_reduce"}
    # 2 blocks x (weight, bias) of 16 fp32 = 4 x 64 B, 3 all-reduces each: 12 x 64 = 768 B
    assert sum(c["count"] for c in opt_rows) == 12
    assert t.record.totals["comm_bytes"]["optimizer"] == 768


def test_a_collective_the_dispatch_mode_cannot_see_is_named(mesh4):
    """An all-reduce issued with torch dispatch disabled never reaches any dispatch mode
    (CommDebugMode misses it too): the record says so instead of leaving it out silently."""
    model = torch.nn.Linear(4, 4)
    buf = torch.ones(256)                               # 1,024 B
    with torchledger.trace(model) as t:
        model(torch.randn(2, 4)).sum().backward()
        dist.all_reduce(buf)                            # seen
        with torch._C._DisableTorchDispatch():
            dist.all_reduce(buf)                        # not seen
    rows = [c for c in t.record.collectives if c["op"] == "all_reduce"]
    assert sum(c["count"] for c in rows) == 1 and t.record.totals["comm_bytes"]["total"] == 1024
    [w] = [w for w in t.record.warnings if w.startswith("collectives not seen")]
    assert "all_reduce 2 time(s)" in w and "saw 1" in w
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"
    assert not hasattr(dist.all_reduce, "__wrapped__") or "counted" not in dist.all_reduce.__qualname__


def test_every_collective_seen_no_warning(mesh4):
    model = torch.nn.Linear(4, 4)
    with torchledger.trace(model) as t:
        model(torch.randn(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(8))
        out = torch.empty(32)
        dist.all_gather_into_tensor(out, torch.ones(8))
    assert not [w for w in t.record.warnings if w.startswith("collectives not seen")]
    assert {c["op"] for c in t.record.collectives} == {"all_reduce", "all_gather"}


def test_blocking_p2p_counts_once(mesh4):
    """``dist.send`` is ``isend`` + wait and ``dist.recv`` is ``irecv`` + wait: one user call
    each, one collective each, no false "not seen" (a pipeline stage's p2p, issue 22)."""
    model = torch.nn.Linear(4, 4)
    buf = torch.empty(64)                               # 64 x 4 B = 256 B
    with torchledger.trace(model) as t:
        model(torch.randn(2, 4)).sum().backward()
        dist.send(torch.ones(64), dst=1)
        dist.recv(buf, src=1)
        dist.isend(torch.ones(64), dst=2).wait()
    assert not [w for w in t.record.warnings if w.startswith("collectives not seen")]
    def total(op, key):
        return sum(c[key] for c in t.record.collectives if c["op"] == op)
    assert total("send", "count") == 2 and total("send", "bytes") == 2 * 256
    assert total("recv", "count") == 1 and total("recv", "bytes_received") == 256


def test_a_send_the_dispatch_mode_cannot_see_is_named(mesh4):
    model = torch.nn.Linear(4, 4)
    with torchledger.trace(model) as t:
        model(torch.randn(2, 4)).sum().backward()
        dist.send(torch.ones(64), dst=1)                # seen
        with torch._C._DisableTorchDispatch():
            dist.send(torch.ones(64), dst=1)            # not seen: 2 calls, 1 seen
    [w] = [w for w in t.record.warnings if w.startswith("collectives not seen")]
    assert "send 2 time(s)" in w and "saw 1" in w
