"""DDP and FSDP2 steps traced per rank: comm bytes against their closed forms, per-rank
memory counted as the local shards, FLOPs this rank's, and the step's numbers unchanged.

World size 8 runs on PyTorch's fake process group (one process, real CPU tensors, no
communication: every rank of an SPMD step does what rank 0 does); world size 1 runs DDP's
own reducer over gloo.
"""
from __future__ import annotations

import math

import gc

import pytest
import torch
import torch.distributed as dist

import torchledger
from torchledger.formulas.comm import comm_per_step, fsdp_padded_bytes

WS = 8


@pytest.fixture
def fake8():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WS)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp(seed=0):
    torch.manual_seed(seed)          # 130 rows: not a multiple of 8, so FSDP2 pads
    return torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.ReLU(), torch.nn.Linear(130, 64),
                               torch.nn.LayerNorm(64))


def _step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _fake_allreduce_hook(state, bucket):
    """DDP's C++ default hook reads the future's value, which the fake group leaves None: this
    hook is the default's work (average, then one all-reduce of the bucket: c10d.allreduce_)
    with a completed future."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _ddp(seed=0):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_mlp(seed))
    if dist.get_backend() == "fake":
        model.register_comm_hook(None, _fake_allreduce_hook)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_ddp_fake_world_8(fake8):
    model, opt = _ddp()
    x = torch.randn(4, 64)
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, x)
    rec = t.record
    g = _param_bytes(model)        # (64*130 + 130 + 130*64 + 64 + 64 + 64) * 4 = 67,848 B
    assert g == 67848
    [c] = rec.collectives                     # one bucket: one all-reduce of every gradient
    assert (c["op"], c["phase"], c["group_size"], c["bytes"]) == ("all_reduce", "backward", WS, g)
    assert c["bus_bytes"] == g * 2 * 7 // 8   # 2(n-1)/n
    closed = comm_per_step(g, gpus=WS, strategy="ddp")
    assert rec.totals["comm_bytes"] == {**closed.sent, "other": 0}
    assert c["bus_bytes"] == closed.bus_bytes
    # replicated: every rank holds all of it
    assert rec.totals["param_bytes"] == g and rec.totals["grad_bytes"] == g
    assert (rec.totals["rank"], rec.totals["world_size"], rec.totals["mesh"]) == (0, WS, [WS])   # no DeviceMesh: [world_size]
    assert rec.uncounted_ops == [] or all("c10d" not in u["op"] for u in rec.uncounted_ops)
    assert not any("c10d" in o["op"] for o in rec.ops)


def test_ddp_gloo_world_1(tmp_path):
    """DDP's own reducer and C++ comm hook over a real (one-rank) gloo group."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    # NB: an in-memory store, and DDP's reducer dropped while the group is still up: a
    # FileStore group torn down under the reducer hung once in ~ProcessGroupGloo's thread join
    # (a loaded machine, the full suite), with nothing to time it out
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torchledger.trace(model, optimizer=opt) as t:
            _step(model, opt, torch.randn(4, 64))
        rec = t.record
        expected = _param_bytes(model)
        del model, opt, t
        gc.collect()
    finally:
        dist.destroy_process_group()
    ar = [c for c in rec.collectives if c["op"] == "all_reduce"]
    assert sum(c["bytes"] for c in ar) == expected
    assert {c["phase"] for c in ar} == {"backward"} and {c["group_size"] for c in ar} == {1}
    assert sum(c["bus_bytes"] for c in ar) == 0               # 2(n-1)/n = 0 at n = 1
    assert rec.totals["world_size"] == 1


def _fsdp(seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WS,))
    model = _mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)            # the root: the LayerNorm's parameters
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _local_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        out += local.numel() * local.element_size()
    return out


def test_fsdp2_fake_world_8_per_rank_shards(fake8):
    model, opt = _fsdp()
    x = torch.randn(4, 64)
    _step(model, opt, x)                     # warm-up: lazy init and optimizer state
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, x)
    rec, tot = t.record, t.record.totals
    params = list(model.parameters())
    # rank 0 holds ceil(130/8) = 17 rows of each 130-row parameter, 8 of each 64-row one:
    # (17*64 + 17 + 8*130 + 8 + 8 + 8) * 4 = 8,676 B
    assert _local_bytes(params) == 8676
    assert tot["param_bytes"] == 8676 and tot["trainable_param_bytes"] == 8676
    assert tot["params"] == sum(p.numel() for p in params) == 16962      # N stays the model's
    # N of 6ND: the weights the matmuls multiply, read off FSDP2's unsharded (unpadded) views
    assert tot["matmul_params"] == 64 * 130 + 130 * 64 == 16640
    assert (tot["rank"], tot["world_size"], tot["mesh"]) == (0, WS, [WS])
    assert rec.memory["peak_breakdown"]["parameters"] == 8676
    assert tot["grad_bytes"] == 8676          # zero_grad(set_to_none) freed them: the most alive at once
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert tot["optimizer_state_bytes"] == _local_bytes(state) == 2 * 8676 + 6 * 4   # m, v + 6 step scalars
    # the gathered parameters are their own category, live in forward and backward only
    peak = rec.memory["peak_breakdown"]
    assert "unsharded_params" in rec.memory["categories"] and peak["unsharded_params"] > 0
    assert rec.memory["end_breakdown"]["unsharded_params"] == 0
    assert sum(peak.values()) == tot["peak_bytes"]
    assert peak["unsharded_params"] <= 2 * fsdp_padded_bytes([p.shape for p in params], 4, WS)
    # FLOPs are this rank's: the unsharded model's on the local batch. Forward 2*4*(64*130 +
    # 130*64) = 133,120; backward twice that less the first layer's input grad (x needs none):
    # 266,240 - 2*4*64*130 = 199,680; the same as the plain model traced on the same batch
    assert tot["flops"]["forward"] == 133120 and tot["flops"]["backward"] == 199680
    plain = _mlp()
    plain_opt = torch.optim.AdamW(plain.parameters())
    with torchledger.trace(plain, optimizer=plain_opt) as t2:
        _step(plain, plain_opt, x)
    assert t2.record.totals["flops"] == tot["flops"]
    assert rec.uncounted_ops == [] and not any(c["op"].startswith("fsdp") for c in rec.copies)


def test_fsdp2_comm_against_closed_form(fake8):
    model, opt = _fsdp()
    x = torch.randn(4, 64)
    _step(model, opt, x)
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, x)
    rec = t.record
    shapes = [p.shape for p in model.parameters()]
    padded = fsdp_padded_bytes(shapes, 4, WS)            # W1 and b1: 130 -> 136 rows; W2 has 64 rows
    assert padded == (136 * 64 + 136 + 64 * 130 + 3 * 64) * 4 == 69408
    closed = comm_per_step(padded, gpus=WS, strategy="fsdp")
    comm = rec.totals["comm_bytes"]
    assert comm["forward"] == closed.sent["forward"] == padded // WS
    # the gap: FSDP2 keeps the root's parameters (the LayerNorm, 2*64 fp32 = 512 B gathered)
    # gathered from forward to backward, so backward re-gathers all but the root's share
    root_share = 2 * 64 * 4 // WS
    assert comm["backward"] == closed.sent["backward"] - root_share
    rs = sum(c["bytes"] for c in rec.collectives if c["op"] == "reduce_scatter")
    assert rs == padded                                  # every gradient, padded, reduce-scattered once
    assert {c["phase"] for c in rec.collectives if c["op"] == "reduce_scatter"} == {"backward"}
    bus = sum(c["bus_bytes"] for c in rec.collectives)
    assert bus == closed.bus_bytes - (2 * 64 * 4) * 7 // 8


def test_fsdp2_static_bytes_against_zero3(fake8):
    try:
        from torchledger.formulas.memory import static_memory
    except ImportError:
        from torchledger.analyzers.memory import static_memory
    model, opt = _fsdp()
    x = torch.randn(4, 64)
    _step(model, opt, x)
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, x)
    tot = t.record.totals
    measured = tot["param_bytes"] + tot["grad_bytes"] + tot["optimizer_state_bytes"]
    n = tot["params"]
    closed = static_memory(n, "adamw", "fp32", gpus=WS, zero=3).per_gpu_bytes     # 16 N / 8
    # the gap, exactly: rank 0's shards are padded up (17 of 130 rows, not 16.25) and AdamW
    # keeps one fp32 step scalar per parameter, unsharded
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    padding = 16 * (local_numel - n / WS)
    steps = 4 * len(list(model.parameters()))
    assert math.isclose(measured, closed + padding + steps)
    assert measured / closed - 1 < 0.05


def _bitwise(make, fake=True):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    runs = []
    for traced in (False, True):
        model, opt = make(seed=0)
        _step(model, opt, x)
        if traced:
            with torchledger.trace(model, optimizer=opt):
                _step(model, opt, x)
        else:
            _step(model, opt, x)
        runs.append([_local(p).clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p.detach()


def test_traced_ddp_step_is_bitwise_untraced(fake8):
    _bitwise(_ddp)


def test_traced_fsdp2_step_is_bitwise_untraced(fake8):
    _bitwise(_fsdp)


def test_reports_and_findings_of_a_sharded_step(fake8):
    from torchledger.analyzers.comm import check_comm
    from torchledger.render.table import render_table
    model, opt = _fsdp()
    x = torch.randn(4, 64)
    _step(model, opt, x)
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, x)
    rec = t.record
    text = render_table(rec, t.findings())
    assert "collectives (rank 0 of 8, mesh 8;" in text and "unsharded_params" in text
    comm = rec.totals["comm_bytes"]
    assert f"total {comm['total'] / 1024:.1f} KiB" in text      # 86,696 B = 84.7 KiB
    # static bytes against this rank's padded shards, not the whole model's: 16 B x (17*64 + 17
    # + 8*130 + 8 + 8 + 8) = 16 x 2,169 = 34,704 (16N/8 = 33,924 without the padding)
    row = next(r for r in rec.predictions["comparisons"] if r["quantity"].startswith("static bytes"))
    assert row["predicted"] == 16 * 2169 == 34704 and "FSDP shards over 8" in row["explanation"]
    rules = {f.rule for f in t.findings()}
    assert "TL-CMP-002" not in rules and "TL-COMM-001" in rules
    [info] = check_comm(rec)
    # the exact FSDP2 closed form: the root's LayerNorm (512 B) is not re-gathered in backward
    padded = fsdp_padded_bytes([p.shape for p in model.parameters()], 4, WS)
    assert info.expected == comm_per_step(padded, gpus=WS, strategy="fsdp").total - 2 * 64 * 4 // WS
    assert info.measured == comm["total"] == info.expected


def test_extra_all_reduce_is_flagged(fake8):
    from torchledger.analyzers.comm import check_comm
    model, opt = _ddp()
    _step(model, opt, torch.randn(4, 64))
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, torch.randn(4, 64))
        for p in model.parameters():          # a second, needless all-reduce of every weight
            dist.all_reduce(p.data)
    found = {f.rule: f for f in check_comm(t.record)}
    # DDP's second iteration also rebuilds its buckets: two small broadcasts of bucket indices
    rebuild = sum(c["bytes"] for c in t.record.collectives if c["op"] == "broadcast")
    assert 0 < rebuild < 1024
    assert found["TL-COMM-001"].measured == 2 * _param_bytes(model) + rebuild
    assert found["TL-COMM-001"].expected == _param_bytes(model)        # DDP: one all-reduce of G
    assert "TL-COMM-002" in found and "2.00x" in found["TL-COMM-002"].message


def test_fsdp2_fake_tensors_peak_matches_fsdp_mem_tracker(fake8):
    """The anchor: PyTorch's FSDPMemTracker (torchtitan's memory estimation) on the same
    FakeTensorMode step at world size 8. Its categories split differently (it names the
    all-gather and reduce-scatter buffers apart; we count the first as unsharded_params, the
    second as temporaries), the per-rank peak is what must agree."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    tracker_mod = pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")
    mesh = init_device_mesh("cpu", (WS,))
    with FakeTensorMode():
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 1376, bias=False), torch.nn.ReLU(),
                                                          torch.nn.Linear(1376, 512, bias=False)) for _ in range(4)])
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(16, 512)
        _step(model, opt, x)
        fmt = tracker_mod.FSDPMemTracker(model, opt)
        fmt.track_inputs((x,))
        with fmt:
            _step(model, opt, x)
        theirs = fmt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        with torchledger.trace(model, optimizer=opt) as t:
            _step(model, opt, x)
    rec = t.record
    assert abs(rec.totals["peak_bytes"] / theirs - 1) < 0.02, (rec.totals["peak_bytes"], theirs)
    # shards: 4 blocks x 2 x 512*1376 fp32 / 8 = 2,818,048 B of parameters on this rank
    assert rec.totals["param_bytes"] == 4 * 2 * 512 * 1376 * 4 // WS == 2818048
    assert rec.memory["peak_breakdown"]["parameters"] == 2818048


@pytest.mark.parametrize("fmt", ["table", "json", "csv", "markdown", "html", "sarif"])
def test_every_format_renders_a_distributed_record(fake8, fmt):
    from torchledger import StepRecord
    from torchledger.render import render
    model, opt = _fsdp()
    _step(model, opt, torch.randn(4, 64))
    with torchledger.trace(model, optimizer=opt) as t:
        _step(model, opt, torch.randn(4, 64))
    back = StepRecord.from_json(t.record.to_json())          # what `report` reads from a file
    out = render(back, t.findings(), fmt)
    assert out and (fmt != "json" or '"collectives"' in out)


def test_tensor_parallel_flops_are_the_ranks(fake8):
    """DTensor ops reach the tracer with global shapes; it counts this rank's share. Column-
    then row-wise parallel MLP over 8 ranks: each rank does 1/8 of every matmul."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = torch.randn(4, 64)
    plain = mlp()
    with torchledger.trace(plain) as t0:
        plain(x).sum().backward()
    tp = parallelize_module(mlp(), init_device_mesh("cpu", (WS,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torchledger.trace(tp) as t1:
        tp(x).sum().backward()
    whole, rank = t0.record.totals["flops"], t1.record.totals["flops"]
    # forward 2*4*(64*128 + 128*64) = 131,072 for the model, 16,384 on each of 8 ranks
    assert whole["forward"] == 131072 and rank["forward"] == 131072 // WS
    assert rank["backward"] == whole["backward"] // WS
    # W1 16 of 128 rows, b1 16, W2 16 of 128 columns, b2 replicated: (1024 + 16 + 1024 + 64) * 4
    assert t1.record.totals["param_bytes"] == 8512
    # the row-wise layer's output is Partial: one all-reduce of the 4 x 64 fp32 output (1,024 B)
    [c] = t1.record.collectives
    assert (c["op"], c["bytes"], c["phase"], c["bus_bytes"]) == ("all_reduce", 1024, "forward", 1024 * 2 * 7 // 8)


def test_fsdp_plus_tp_on_a_2d_mesh(fake8):
    """FSDP over "dp" (2) and tensor parallelism over "tp" (4): mesh [2, 4], shards of both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 64)
    with pytest.warns(UserWarning, match="returned a view"):   # torch's, traced or not (RowwiseParallel's output)
        _step(model, opt, x)
        with torchledger.trace(model, optimizer=opt) as t:
            _step(model, opt, x)
    tot = t.record.totals
    assert tot["mesh"] == [2, 4]
    # W1: 128 rows / 4 (tp) / 2 (dp) = 16 x 64; b1 16; W2: 64 / 2 rows x 128 / 4 columns; b2 64 / 2:
    # (1024 + 16 + 1024 + 32) * 4 = 8,384 B
    assert tot["param_bytes"] == _local_bytes(model.parameters()) == 8384
    assert tot["flops"]["forward"] == 2 * 4 * (64 * 128 + 128 * 64) // 4      # tp = 4 shares the matmuls
    groups = {(c["op"], c["group_size"]) for c in t.record.collectives}
    # FSDP's gathers and reduce-scatters run over dp (2), TP's all-reduce over tp (4); the root
    # module stays gathered from forward to backward: no backward all-gather
    assert groups == {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 4)}
