"""`torchledger audit FILE.py --world-size N [--mesh DxD]`: rank 0 of a simulated world (fake
tensors, fake process group), AuditSpec(parallelize=fn), TL-NET-001's communication time."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

from torchledger.audit.engine import run_audit  # noqa: E402
from torchledger.audit.spec import AuditError  # noqa: E402
from torchledger.cli import cli  # noqa: E402
from test_audit_cli import one_line_error  # noqa: E402  (the one-line-error check all CLI tests share)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def write(tmp_path, body, name="model.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


# llama-tiny: V 512, d 64, L 2, heads 4, d_ff 176; n_kv_heads set to 4 so TP over 4 splits
# whole K/V heads (head_dim 16).
TINY = """
    import torch, torchledger
    from torchledger.models import build_model, get_config

    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def tp_fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        tp, dp = mesh["tp"], mesh["dp"]
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, tp, plan)
            block.attn.n_heads //= tp.size()
            block.attn.n_kv_heads //= tp.size()
            fully_shard(block, mesh=dp)
        return fully_shard(model, mesh=dp)

    PARALLELIZE = fsdp

    def audit_spec():
        cfg = get_config("llama-tiny").replace(n_kv_heads=4)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, 32))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx}, parallelize=PARALLELIZE)
"""

# Full model, llama-tiny with 4 KV heads: per block q, k, v, o 64x64 = 4 x 4,096 = 16,384;
# gate, up 176x64 and down 64x176 = 3 x 11,264 = 33,792; two norms 2 x 64 = 128:
# 50,304 per block; tok_emb and lm_head 512x64 = 32,768 each; final norm 64.
# 2 x 50,304 + 2 x 32,768 + 64 = 166,208 params.
FULL_PARAMS = 166_208
# FSDP2 at world size 8 shards dim 0 of each parameter; every dim 0 here divides by 8
# (64, 176, 512), so rank 0 holds 166,208 / 8 = 20,776 params: 83,104 B of fp32.
FSDP8_LOCAL = 20_776
# mesh 2x4 (dp 2, tp 4): TP'd weights are split 4 ways by TP, then 2 by FSDP: 16,384 / 8 +
# 33,792 / 8 = 2,048 + 4,224 per block; norms, embeddings and head only by FSDP (2):
# 2 x 64 / 2 = 64 per block, 2 x 32,768 / 2 = 32,768, 64 / 2 = 32.
# 2 x (2,048 + 4,224 + 64) + 32,768 + 32 = 45,472 params.
TP_FSDP_LOCAL = 45_472
TENSORS = 2 * 9 + 3          # parameter tensors: 9 per block, tok_emb, norm, lm_head


def audit_json(path, *args):
    r = run("audit", path, "--steps", "1", "--format", "json", *args)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("w8"), TINY)
    r = run("audit", path, "--world-size", "8", "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r


def test_fsdp_world_8_is_rank_0_of_8(fsdp8):
    data, r = fsdp8
    assert data["meta"]["audit"]["world_size"] == 8 and data["meta"]["audit"]["mesh"] == [8]
    assert (data["totals"]["world_size"], data["totals"]["rank"], data["totals"]["mesh"]) == (8, 0, [8])
    assert data["totals"]["params"] == FULL_PARAMS        # the model's parameters, unsharded
    # fake, though the parameters are DTensors: no MFU from a fake step's time
    assert data["meta"]["device"] == "fake (cpu)" and data["totals"]["mfu"] is None
    assert not dist.is_initialized()                     # the fake world is gone


def test_fsdp_world_8_grads_and_adamw_state_are_shards(fsdp8):
    totals = fsdp8[0]["totals"]
    assert totals["grad_bytes"] == FSDP8_LOCAL * 4                      # 83,104
    # AdamW: exp_avg and exp_avg_sq of the shard, plus one fp32 step scalar per tensor:
    # 2 x 83,104 + 21 x 4 = 166,292
    assert totals["optimizer_state_bytes"] == 2 * FSDP8_LOCAL * 4 + TENSORS * 4


def test_fsdp_world_8_param_bytes_are_the_shard(fsdp8):
    assert fsdp8[0]["totals"]["param_bytes"] == FSDP8_LOCAL * 4              # to_local(): 83,104 B


def test_fsdp_world_8_collectives_point_at_no_runner_frame(fsdp8):
    # FSDP2's hooks issue the collectives under audit's own step: the first frame outside torch
    # and torchledger is click's, not a line of the user's; such a collective has no location
    rows = fsdp8[0]["collectives"]
    assert rows and {c["op"] for c in rows} == {"all_gather", "reduce_scatter"}
    assert all(c["location"] is None for c in rows), {c["location"] for c in rows}
    # and 6ND's N is the unsharded matmul weights, not 0 (the sharded parameters never enter a matmul)
    assert fsdp8[0]["totals"]["matmul_params"] > 0
    assert fsdp8[0]["predictions"]["flops_6nd"] == 6 * fsdp8[0]["totals"]["matmul_params"] * fsdp8[0]["totals"]["tokens"]


def test_report_header_says_rank_0_of_n(tmp_path, fsdp8):
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps(fsdp8[0]))
    r = run("report", str(rec), "--format", "table")
    assert r.exit_code == 0, r.output
    assert ("simulated world: rank 0 of 8 (mesh 8; fake tensors, fake process group); ranks of an "
            "SPMD step are alike") in r.stdout


def test_tp_fsdp_mesh_2x4(tmp_path):
    path = write(tmp_path, TINY.replace("PARALLELIZE = fsdp", "PARALLELIZE = tp_fsdp"))
    data = audit_json(path, "--mesh", "2x4")              # --mesh implies --world-size 8
    totals = data["totals"]
    assert (totals["world_size"], totals["mesh"]) == (8, [2, 4])
    assert totals["grad_bytes"] == TP_FSDP_LOCAL * 4                    # 181,888
    assert totals["optimizer_state_bytes"] == 2 * TP_FSDP_LOCAL * 4 + TENSORS * 4
    assert not dist.is_initialized()
    # TP 4 splits each block weight at its matmul: N of 6ND is this rank's part (2 blocks x
    # (16,384 + 33,792) / 4 = 25,088) plus the whole head (32,768); attention gets 1/4 of the heads
    assert totals["tensor_parallel"] == 4
    assert totals["matmul_params"] == 2 * (16_384 + 33_792) // 4 + 32_768
    rows = {r["quantity"]: r for r in data["predictions"]["comparisons"]}
    assert rows["training FLOPs vs 6ND + 12LTd"]["ratio"] == 1.0
    assert "tensor parallel 4" in rows["training FLOPs vs 6ND + 12LTd"]["explanation"]
    # static bytes: each weight's share as laid out (TP's split, then FSDP's), 16 B x 45,472;
    # AdamW's 21 fp32 step scalars (84 B) are the difference
    static = rows["static bytes (params+grads+optimizer)"]
    assert static["predicted"] == 16 * TP_FSDP_LOCAL and static["measured"] == static["predicted"] + TENSORS * 4
    rules = {f["rule"]: f for f in data["findings"]}
    assert not set(rules) & {"TL-CMP-001", "TL-CMP-002", "TL-COMM-002"}, rules
    # FSDP's collectives (group of 2) against FSDP2's closed form, TP's (group of 4) beside it
    assert "(1.000x) (data-parallel collectives only)" in rules["TL-COMM-001"]["message"]
    # mesh 2x4, ranks placed row by row: rank 0's TP group is ranks 0-3 (span 4), its FSDP
    # group ranks 0 and 4 (span 5)
    spans = {(c["op"], c["group_size"]): c["group_span"] for c in data["collectives"]}
    assert set(spans.values()) == {4, 5}
    assert spans[("reduce_scatter", 2)] == 5 and spans[("all_reduce", 4)] == 4


def test_plain_audit_does_not_call_parallelize(tmp_path):
    path = write(tmp_path, TINY.replace("PARALLELIZE = fsdp", "PARALLELIZE = lambda m, mesh: 1 / 0"))
    data = audit_json(path)
    assert "world_size" not in data["meta"]["audit"]
    assert "world_size" not in data["totals"] or data["totals"]["world_size"] == 1
    assert data["totals"]["param_bytes"] == FULL_PARAMS * 4       # 664,832: one process, unsharded


@pytest.mark.parametrize("args, needles", [
    (("--world-size", "8", "--mesh", "3x3"), ("--mesh 3x3", "multiply to 9", "--world-size 8")),
    (("--world-size", "0"), ("--world-size", ">= 1", "0")),
    (("--world-size", "-3"), ("--world-size", ">= 1",)),
    (("--mesh", "8xx"), ("--mesh", "8x8")),
    (("--mesh", "0x8"), ("--mesh", ">= 1")),
    (("--world-size", "8", "--device", "cpu"), ("--device cpu", "fake", "torchrun")),
    (("--mesh", "2x4", "--device", "meta"), ("--device meta", "8 ranks")),
])
def test_bad_world_flags_are_one_line(tmp_path, args, needles):
    path = write(tmp_path, TINY)
    one_line_error(run("audit", path, "--steps", "1", *args), *needles)
    assert not dist.is_initialized()


def test_parallelize_not_callable_is_one_line(tmp_path):
    path = write(tmp_path, TINY.replace("PARALLELIZE = fsdp", "PARALLELIZE = 3"))
    one_line_error(run("audit", path, "--world-size", "8", "--steps", "1"),
                   "AuditSpec.parallelize must be callable or None, got int")
    assert not dist.is_initialized()


def test_no_parallelize_at_world_size_above_1_applies_the_standard_plan(tmp_path):
    # without AuditSpec.parallelize, torchledger shards the model itself (FSDP2 per block and
    # the root): the same shards as the file's own fsdp plan
    path = write(tmp_path, TINY.replace("PARALLELIZE = fsdp", "PARALLELIZE = None"))
    data = audit_json(path, "--world-size", "8")
    assert data["totals"]["param_bytes"] == FSDP8_LOCAL * 4
    assert data["meta"]["audit"]["plan"][0].startswith("FSDP2 over 8 ranks")
    assert not dist.is_initialized()


def test_parallelize_must_return_the_model(tmp_path):
    path = write(tmp_path, TINY.replace("PARALLELIZE = fsdp", "PARALLELIZE = lambda m, mesh: None"))
    one_line_error(run("audit", path, "--world-size", "2", "--steps", "1"),
                   "returned NoneType", "return model")
    assert not dist.is_initialized()


def test_process_group_destroyed_when_the_step_raises(tmp_path):
    body = TINY.replace("parallelize=PARALLELIZE)", "parallelize=PARALLELIZE, loss_fn=lambda out, inp: 1 / 0)")
    path = write(tmp_path, body)
    with pytest.raises(AuditError, match="ZeroDivisionError"):
        run_audit(path, steps=1, world_size=8)
    assert not dist.is_initialized()


def test_process_group_destroyed_on_keyboard_interrupt(tmp_path):
    body = TINY.replace("PARALLELIZE = fsdp", "def PARALLELIZE(model, mesh):\n        raise KeyboardInterrupt")
    path = write(tmp_path, body)
    with pytest.raises(KeyboardInterrupt):
        run_audit(path, steps=1, world_size=4)
    assert not dist.is_initialized()


def test_an_existing_process_group_is_refused_and_kept(tmp_path):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    path = write(tmp_path, TINY)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(AuditError, match="already initialised"):
            run_audit(path, steps=1, world_size=8)
        assert dist.is_initialized()          # the user's own group is not ours to destroy
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_peak_against_fsdp_mem_tracker():
    """The fake-world FSDP2 peak of rank 0 against torch's FSDPMemTracker on the same step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    import torchledger
    from torchledger.models import build_model, get_config
    from torchledger.audit.world import fake_world

    def one(kind):
        with fake_world(8, (8,)) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
            cfg = get_config("llama-tiny")
            model = build_model(cfg)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            idx = torch.randint(0, cfg.vocab_size, (2, 64))
            opt = torch.optim.AdamW(model.parameters())

            def step():
                model(idx, idx).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if kind == "tracker":
                tracker = FSDPMemTracker(model, opt)
                tracker.track_inputs((idx,))
                with tracker:
                    for i in range(2):
                        step()
                        if i == 0:
                            tracker.reset_mod_stats()
                (peak,) = tracker.get_tracker_snapshot("peak").values()
                return peak["Total"]
            ledger = torchledger.Ledger(model, optimizer=opt)
            for _ in range(2):
                with ledger.step(tokens=idx.numel()):
                    step()
            return ledger.records[-1].totals["peak_bytes"]

    expected, measured = one("tracker"), one("ledger")
    # the tracer follows FSDP2's untyped_storage().resize_(0)/resize_(n) of the unsharded
    # parameters (their own category, unsharded_params), as FSDPMemTracker does. The tracker
    # sees the CPU composite of nn.RMSNorm, which keeps the normalized copy too; the tracer
    # counts CUDA's fused kernel (input and rstd only: tracer/gpu_kernels.py): 5 norms (2 per
    # block, the final one) x 2 x 64 tokens x d 64 x 4 B = 163,840 B fewer, alive at the peak
    cpu_only = 5 * 2 * 64 * 64 * 4
    assert abs(measured + cpu_only - expected) <= 0.02 * expected, (measured, expected)


# -- TL-NET-001: communication time ---------------------------------------------------------------
def test_comm_seconds_by_hand():
    from torchledger.formulas.interconnect import comm_seconds, compute_seconds
    # FSDP all-gather of 1 GB per rank at world size 8: each rank sends (8-1)/8 x 1e9 = 8.75e8 B;
    # at 450 GB/s bus bandwidth: 8.75e8 / 4.5e11 = 1.944 ms
    assert comm_seconds(8.75e8, 450e9) == pytest.approx(1.9444e-3, rel=1e-4)
    # 6 x 7e9 x 2048 = 8.6016e13 FLOPs at 40% of 989.5 TFLOP/s: 8.6016e13 / 3.958e14 = 0.21732 s
    assert compute_seconds(6 * 7e9 * 2048, 989.5e12, 0.4) == pytest.approx(0.21732, rel=1e-4)
    with pytest.raises(ValueError):
        comm_seconds(1, 0)


def test_link_bandwidth_one_node_and_across_nodes():
    from torchledger.formulas.interconnect import get_link, link_bandwidth
    h100 = get_link("H100")
    assert link_bandwidth(h100, 8) == (450e9, "NVLink, one node")
    # 64 ranks = 8 nodes: the ring crosses each node's 8 x 400 Gb/s = 400 GB/s of InfiniBand
    assert link_bandwidth(h100, 64) == (400e9, "InfiniBand per node, ring across 8 nodes")
    assert link_bandwidth(get_link("B200"), 16)[0] == 400e9
    assert link_bandwidth(get_link("A100"), 4)[0] == 300e9


def _comm_record(bus_forward, bus_backward, flops, world, bus=True):
    from torchledger.record import StepRecord
    rec = StepRecord()
    n = world
    # FSDP-like rows: an all-gather of a shard S_in: payload S_in, bus bytes n S_in (n-1)/n
    rows = [{"op": "all_gather", "phase": "forward", "group_size": n, "count": 1,
             "bytes": bus_forward // (n - 1), "bus_bytes": bus_forward},
            {"op": "reduce_scatter", "phase": "backward", "group_size": n, "count": 1,
             "bytes": bus_backward * n // (n - 1), "bus_bytes": bus_backward}]
    if not bus:
        for r in rows:
            del r["bus_bytes"]
    rec.collectives = rows
    payload = sum(r["bytes"] for r in rows)
    rec.totals.update(world_size=world, rank=0, flops={"total": flops},
                      comm_bytes={"forward": rows[0]["bytes"], "backward": rows[1]["bytes"], "optimizer": 0,
                                  "other": 0, "total": payload})
    return rec


def test_net_time_splits_groups_inside_and_across_nodes():
    from torchledger.analyzers.interconnect import check_comm_time
    from torchledger.record import StepRecord
    rec = StepRecord()
    rec.totals.update(world_size=64, flops={"forward": 0, "backward": 0, "optimizer": 0, "total": 10**12})
    # a TP group inside a node (span 8) and an FSDP group strided across 8 nodes (span 57)
    rec.collectives = [
        {"op": "all_reduce", "bytes": 1, "group_size": 8, "group_span": 8, "phase": "forward",
         "module": None, "location": None, "count": 1, "bus_bytes": 450 * 10**9},
        {"op": "all_gather", "bytes": 1, "group_size": 8, "group_span": 57, "phase": "forward",
         "module": None, "location": None, "count": 1, "bus_bytes": 400 * 10**9}]
    (f,) = check_comm_time([rec], {"gpu": "h100"})
    # 450 GB at H100 NVLink 450 GB/s + 400 GB at DGX H100 InfiniBand 400 GB/s = 1 s + 1 s
    assert f.measured == pytest.approx(2.0)
    assert "at 450 GB/s (H100 SXM NVLink, groups within a node)" in f.message
    assert "at 400 GB/s (H100 SXM InfiniBand per node, groups across nodes)" in f.message
    # the same bytes all inside a node: NVLink alone, whatever the world size
    for c in rec.collectives:
        c["group_span"] = 8
    (f,) = check_comm_time([rec], {"gpu": "h100"})
    assert f.measured == pytest.approx(850 / 450) and "NVLink, groups within a node" in f.message


def test_step_bus_bytes_prefers_the_rows_bus_bytes():
    from torchledger.analyzers.interconnect import step_bus_bytes
    rec = _comm_record(63_000, 126_000, 1, 64)
    assert step_bus_bytes(rec) == (189_000, {"forward": 63_000, "backward": 126_000}, "bus bytes")
    # without bus bytes: the payload, 63,000 / 63 + 126,000 x 64 / 63 = 1,000 + 128,000, labelled so
    total, phases, kind = step_bus_bytes(_comm_record(63_000, 126_000, 1, 64, bus=False))
    assert (total, phases["forward"], phases["backward"]) == (129_000, 1_000, 128_000)
    assert kind.startswith("payload bytes")


def test_net_finding_compute_bound_and_comm_bound():
    from torchledger.analyzers.interconnect import check_comm_time
    # 40 GB of bus bytes at 400 GB/s (H100, 64 ranks = 8 nodes) = 100 ms;
    # 8.6016e13 FLOPs at 0.4 x 989.5 TFLOP/s = 217.3 ms: communication 46% of compute
    rec = _comm_record(10_000_000_000, 30_000_000_000, 86_016_000_000_000, 64)
    (f,) = check_comm_time([rec], {"gpu": "H100"})
    assert (f.rule, f.severity) == ("TL-NET-001", "info")
    assert f.measured == pytest.approx(0.1) and f.expected == pytest.approx(0.21732, rel=1e-4)
    assert "46% of compute" in f.message and "InfiniBand" in f.message and "of bus bytes" in f.message
    # the same bytes at --link-bandwidth 100GB/s: 400 ms > 217 ms: communication-bound
    (f,) = check_comm_time([rec], {"gpu": "H100", "link_bandwidth": 100e9, "assumed_mfu": 0.4})
    assert f.severity == "warning" and f.measured == pytest.approx(0.4)
    # no collectives and no comm bytes (a single-process record): nothing; no GPU or link: nothing
    rec = _comm_record(63, 63, 1, 64)
    rec.collectives = []
    del rec.totals["comm_bytes"]
    assert check_comm_time([rec], {"gpu": "H100"}) == []
    assert check_comm_time([_comm_record(63, 63, 10, 8)], {}) == []


def test_gpu_fit_speaks_of_each_rank(fsdp8):
    from torchledger.analyzers.fit import check_gpu_fit
    from torchledger.record import StepRecord
    rec = StepRecord.from_dict(fsdp8[0])
    (f,) = check_gpu_fit([rec], {"gpu": "H100"})
    # the tiny model's peak is a few MB: it fits at world size 8
    assert f.rule == "TL-MEM-002" and f.severity == "info"
    assert f.message.startswith("the step fits at world size 8: each rank's peak (rank 0's), ")
    assert f.measured == fsdp8[0]["totals"]["peak_bytes"]
    big = StepRecord.from_dict(fsdp8[0])
    big.totals["peak_bytes"] = 90e9                  # 90 GB > 85.0 GB: an error, worded per rank
    (f,) = check_gpu_fit([big], {"gpu": "H100"})
    assert f.severity == "error" and f.message.startswith("the step does not fit at world size 8: each rank's peak")
    # an H100 80GB gives a process 79.18 GiB = 85.02e9 B: 90 / 85.02 = 1.0586
    assert "105.9% of one H100 SXM's 85.0 GB (79.2 GiB)" in f.message


def test_mfu_option_reaches_the_net_finding(tmp_path):
    """``--mfu`` end to end: with ``--link-bandwidth`` (TL-NET-001's bandwidth form; ``--gpu``
    alone uses the predicted step time) the compute time is the step's FLOPs at the user's MFU
    of the part's bf16 peak, not at the 0.4 default."""
    from torchledger.formulas.hardware import get_gpu
    path = write(tmp_path, TINY)
    data = audit_json(path, "--world-size", "8", "--gpu", "h100", "--link-bandwidth", "100GB/s",
                      "--mfu", "0.25")
    (f,) = [f for f in data["findings"] if f["rule"] == "TL-NET-001"]
    flops = data["totals"]["flops"]["total"]
    peak = get_gpu("h100").peak_flops["bf16"]
    assert f["expected"] == pytest.approx(flops / (0.25 * peak))        # 0.4 would give 0.625x this
    assert "MFU 25%" in f["message"]


def test_net_finding_shows_small_times_in_their_unit():
    # issue 20 item 6: a small step printed "take 0.0 ms ... 1171% of compute"
    from torchledger.analyzers.interconnect import check_comm_time
    # 63,000 + 126,000 = 189,000 bus bytes at --link-bandwidth 100 GB/s: 1.89 us;
    # 1.6e9 FLOPs at 0.4 x 989.5 TFLOP/s = 4.04 us: communication 1.89 / 4.04 = 47% of compute
    rec = _comm_record(63_000, 126_000, 1_600_000_000, 64)
    (f,) = check_comm_time([rec], {"gpu": "H100", "link_bandwidth": 100e9})
    assert "take 1.89 us at 100 GB/s" in f.message and "takes 4.04 us" in f.message, f.message
    assert "47% of compute" in f.message and "0.0 ms" not in f.message
    # 1.6e7 FLOPs: 40.4 ns of compute, communication 46.8x: said as a multiple
    (f,) = check_comm_time([_comm_record(63_000, 126_000, 16_000_000, 64)],
                           {"gpu": "H100", "link_bandwidth": 100e9})
    assert "takes 40.4 ns" in f.message and "communication is 46.8x compute" in f.message, f.message
    # at H100's 400 GB/s across 8 nodes: 189,000 / 4e11 = 472.5 ns
    (f,) = check_comm_time([_comm_record(63_000, 126_000, 16_000_000, 64)], {"gpu": "H100"})
    assert "take 472 ns at 400 GB/s" in f.message, f.message


def test_fsdp_world_8_optimizer_reads_the_shards(fsdp8):
    # AdamW's default on a GPU is its foreach path (DTensors are on its list): exp_avgs.lerp_
    # (grads, 1 - beta1) reads the 21 exp_avg and grad DTensor shards: 2 x 83,104 B (a list's
    # elements counted at their global size would be 8x that)
    data = fsdp8[0]
    (row,) = [o for o in data["ops"] if o["op"] == "aten._foreach_lerp_.Scalar" and o["phase"] == "optimizer"]
    assert row["bytes_read"] == 2 * FSDP8_LOCAL * 4
    assert "optimizer_foreach" in data["meta"]["gpu_kernels"]


def test_fsdp_world_8_for_loop_optimizer_reads_the_shards(tmp_path):
    """AdamW(foreach=False): the for-loop, one parameter at a time, reads the same shards."""
    body = TINY.replace('parallelize=PARALLELIZE)', 'parallelize=PARALLELIZE,\n'
                        '                                     optimizer=lambda p: torch.optim.AdamW(p, foreach=False))')
    assert body != TINY
    r = run("audit", write(tmp_path, body), "--world-size", "8", "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    ops = [o for o in json.loads(r.stdout)["ops"] if o["phase"] == "optimizer"]
    (lerp,) = [o for o in ops if o["op"] == "aten.lerp_.Scalar"]
    assert lerp["bytes_read"] == 2 * FSDP8_LOCAL * 4 and lerp["count"] == TENSORS
    assert not [o for o in ops if o["op"].startswith("aten._foreach_")]
