"""Behaviours that planted bugs showed no test pinned (distributed, rank merge, integrations,
schema, Ledger, tracer lifecycle). Each test names the bug it catches; the arithmetic is by
hand in the comments.
"""
from __future__ import annotations

import json
import signal
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchledger
from torchledger.analyzers.comm import check_comm, sharding
from torchledger.analyzers.compare import predictions
from torchledger.analyzers.interconnect import step_bus_bytes
from torchledger.analyzers.ranks import DEFAULTS, merge_ranks
from torchledger.formulas.comm import comm_per_step, fsdp_padded_bytes
from torchledger.formulas.memory import static_memory
from torchledger.record import StepRecord
from torchledger.record.jsonio import MAX_DEPTH, RecordError, parse_record
from torchledger.tracer.ranks import mesh_shape

N = 4


def _traced(fn):
    model = nn.Linear(2, 2)
    with torchledger.trace(model) as t:
        fn()
    return t.record


# -- 1. the coalesced all-gather reads its inputs and outputs the right way round ---------------
def test_coalesced_all_gather_sends_the_shards_and_receives_the_gathered(fake_pg):
    shards = [torch.ones(64), torch.ones(32)]                     # (64 + 32) x 4 B = 384 B sent
    outs = [torch.empty(64 * N), torch.empty(32 * N)]              # 384 x 4 ranks = 1,536 B filled
    rec = _traced(lambda: torch.ops.c10d.allgather_into_tensor_coalesced_(outs, shards, fake_pg.boxed()))
    (c,) = [c for c in rec.collectives if c["op"] == "all_gather"]
    assert (c["bytes"], c["bytes_received"], c["algo_bytes"]) == (384, 1536, 1536)
    assert c["bus_bytes"] == 1536 * 3 // 4                         # (n-1)/n of the gathered: 1,152
    assert rec.totals["comm_bytes"]["total"] == 384


# -- 2. bus bytes round after the factor, not before ---------------------------------------------
def test_bus_bytes_of_a_size_the_group_does_not_divide(fake_pg):
    x = torch.ones(5, dtype=torch.int8)                           # 5 B: 5 x 2 x 3 / 4 = 7.5 -> 7
    rec = _traced(lambda: dist.all_reduce(x))                      # (5 // 4) x 6 = 6 would be wrong
    (c,) = rec.collectives
    assert (c["bytes"], c["algo_bytes"], c["bus_bytes"]) == (5, 5, 7)
    # the closed form rounds the same way: all-reduce of 5 B over 4 ranks
    assert comm_per_step(5, gpus=4, strategy="ddp").bus_bytes == 7
    # all-gather of 10 B over 4 ranks: a shard of ceil(10 / 4) = 3 B, bus 10 x 3 / 4 = 7.5 -> 7
    fsdp = comm_per_step(10, gpus=4, strategy="fsdp", reshard_after_forward=False)
    assert fsdp.sent["forward"] == 3 and fsdp.ops[0][4] == 7


# -- 3. an FSDP shard of rows the world does not divide is rounded up ----------------------------
def test_fsdp_padded_bytes_round_each_parameter_up():
    # 5 rows over 4 ranks: ceil(5 / 4) = 2 rows each, 8 rows gathered x 3 cols x 4 B = 96 B
    assert fsdp_padded_bytes([(5, 3)], 4, 4) == 96
    # per parameter, not on the sum: (1,) and (1,) over 4 ranks pad to 4 + 4 elements = 32 B
    assert fsdp_padded_bytes([(1,), (1,)], 4, 4) == 32
    # a dim the world divides is not padded: 8 x 2 x 2 B = 32
    assert fsdp_padded_bytes([(8, 2)], 2, 4) == 32
    # the comm closed form's shard of P = 97 B over 4 ranks rounds up: 25 B sent per all-gather
    step = comm_per_step(97, gpus=4, strategy="fsdp")
    assert step.sent["forward"] == 25 and step.sent["backward"] == 25 + 97


def _dist_record(*, dtype="float32", params=1000, param_bytes=4000, world=4, collectives=()):
    rec = StepRecord()
    rec.meta["dtype"] = dtype
    rec.totals.update(params=params, param_bytes=param_bytes, world_size=world, rank=0, mesh=[world])
    rec.collectives = [dict(c) for c in collectives]
    total = sum(c["bytes"] for c in collectives)
    rec.totals["comm_bytes"] = {"forward": 0, "backward": total, "optimizer": 0, "other": 0, "total": total}
    return rec


def _row(op, sent, received, phase="backward"):
    return {"op": op, "bytes": sent, "bytes_received": received, "algo_bytes": max(sent, received),
            "bus_bytes": max(sent, received), "group_size": 4, "phase": phase, "module": None,
            "location": None, "count": 1}


# -- 4. a bf16 record gets its comm comparison (2 bytes a parameter) ------------------------------
def test_bf16_records_are_compared_with_the_closed_form():
    # 1,000 bf16 params = 2,000 B; DDP all-reduces the 2,000 gradient bytes
    rec = _dist_record(dtype="bfloat16", param_bytes=2000, collectives=[_row("all_reduce", 2000, 2000)])
    (f,) = [f for f in check_comm(rec) if f.rule == "TL-COMM-001"]
    assert (f.measured, f.expected) == (2000, 2000)


# -- 5. FSDP is told from its collectives, not only from the shard sizes -------------------------
def test_fsdp_comm_form_is_chosen_from_the_collectives():
    # every parameter held (param bytes = 4,000 = the whole fp32 model), so the shard sizes
    # say "DDP", but the step all-gathered and reduce-scattered: FSDP's closed form, 3 x 1,000 B
    rec = _dist_record(collectives=[_row("all_gather", 1000, 4000, "forward"),
                                    _row("all_gather", 1000, 4000, "backward"),
                                    _row("reduce_scatter", 4000, 1000)])
    assert sharding(rec) == (4, 0)
    (f,) = [f for f in check_comm(rec) if f.rule == "TL-COMM-001"]
    assert "FSDP" in f.message and f.expected == comm_per_step(4000, gpus=4, strategy="fsdp").total
    assert f.expected == 1000 + 1000 + 4000


# -- 7. bus bytes only when every row has them ----------------------------------------------------
def test_step_bus_bytes_falls_back_to_payload_when_a_row_lacks_bus_bytes():
    rows = [_row("all_reduce", 100, 100), _row("all_reduce", 60, 60)]
    rec = _dist_record(collectives=rows)
    assert step_bus_bytes(rec) == (160, {"backward": 160}, "bus bytes")
    del rec.collectives[1]["bus_bytes"]                        # one row without: payload bytes
    total, phases, kind = step_bus_bytes(rec)
    assert (total, phases["backward"]) == (160, 160) and kind.startswith("payload bytes")


# -- 8. rank-merge thresholds and figures at their boundaries --------------------------------------
def _rank(rank, *, peak=100, secs=1.0, flops=1000, world=3):
    rec = StepRecord()
    rec.totals.update(rank=rank, world_size=world, mesh=[world], peak_bytes=peak, step_seconds=secs,
                      param_bytes=40, grad_bytes=40, optimizer_state_bytes=80, tokens=8)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": flops, "other": 0}
    return rec


def _rules(merged):
    return [f.rule for f in merged["findings"]]


def test_rank_peak_at_exactly_the_threshold_is_not_a_finding():
    # median 100 and a skew of 0.5: 150 is exactly at the threshold (100 x 1.5 is exact in
    # binary, 100 x 1.1 is not), no finding; 151 is above it
    opts = {"rank_peak_skew": 0.5}
    at = merge_ranks([_rank(0), _rank(1), _rank(2, peak=150)], options=opts)
    assert "TL-RANK-001" not in _rules(at)
    over = merge_ranks([_rank(0), _rank(1), _rank(2, peak=151)], options=opts)
    assert _rules(over) == ["TL-RANK-001"]
    assert DEFAULTS["rank_peak_skew"] == 0.10
    assert _rules(merge_ranks([_rank(0), _rank(1), _rank(2, peak=111)])) == ["TL-RANK-001"]


def test_skew_figures_are_max_over_median_and_max_over_min():
    merged = merge_ranks([_rank(0, peak=50), _rank(1, peak=100), _rank(2, peak=200)])
    s = merged["skew"]["peak_bytes"]
    assert (s["median"], s["max_over_median"], s["max_over_min"]) == (100, 2.0, 4.0)   # 200/100, 200/50


def test_flops_skew_is_measured_against_the_smallest_rank():
    # FLOPs 1,000 / 1,040 / 1,050: 5% above the smallest is 1,050 -> at the threshold, no finding;
    # against the median (1,040) 1,090 would be 4.8% and pass, against the smallest it is 9%
    at = merge_ranks([_rank(0, flops=1000), _rank(1, flops=1040), _rank(2, flops=1050)])
    assert "TL-RANK-003" not in _rules(at)
    over = merge_ranks([_rank(0, flops=1000), _rank(1, flops=1040), _rank(2, flops=1090)])
    assert "TL-RANK-003" in _rules(over)
    (f,) = [f for f in over["findings"] if f.rule == "TL-RANK-003"]
    assert (f.measured, f.expected) == (1090, 1000)


def test_rank_time_at_exactly_the_threshold_is_not_a_finding():
    at = merge_ranks([_rank(0, secs=1.0), _rank(1, secs=1.0), _rank(2, secs=1.2)])
    assert "TL-RANK-002" not in _rules(at)                         # 1.2 is not above 1.0 x 1.2
    over = merge_ranks([_rank(0, secs=1.0), _rank(1, secs=1.0), _rank(2, secs=1.25)])
    assert "TL-RANK-002" in _rules(over)


def test_pipeline_stages_are_not_judged_as_uneven_ranks():
    # two pipeline stages hold different layers: peaks 100 / 200, FLOPs 1,000 / 1,500 differ by
    # design; the same ranks without p2p between stages are uneven data-parallel ranks
    a, b = _rank(0, world=2), _rank(1, world=2, peak=200, flops=1500)
    assert set(_rules(merge_ranks([a, b]))) == {"TL-RANK-001", "TL-RANK-003"}
    a.collectives = [{"op": "send", "phase": "forward", "bytes": 128, "group_size": 2, "count": 2}]
    b.collectives = [{"op": "recv", "phase": "forward", "bytes": 0, "group_size": 2, "count": 2}]
    merged = merge_ranks([a, b])
    assert merged["pipeline_stages"] and _rules(merged) == []
    slow = _rank(1, world=2, peak=200, flops=1500, secs=2.0)
    slow.collectives = b.collectives
    assert _rules(merge_ranks([a, slow])) == ["TL-RANK-002"]          # a straggler still is one


# -- 9. a mesh with a 0-sized dim is not a shape ---------------------------------------------------
def test_a_zero_sized_mesh_dim_is_refused():
    for bad in ([8, 0], (0,), [2, -1]):
        with pytest.raises(TypeError, match="expected a DeviceMesh or a shape"):
            mesh_shape(bad)
        with pytest.raises(TypeError):
            torchledger.trace(nn.Linear(2, 2), mesh=bad)
    assert mesh_shape((2, 4)) == [2, 4]


# -- 10. the pytest plugin's file names stay short whatever the test id ---------------------------
def test_report_file_stems_are_capped_at_120_characters():
    from torchledger.pytest_plugin import _Report
    rep = _Report("unused")
    long_id = "tests/test_x.py::test_case[" + "p" * 160 + "]"      # 188 characters: under 255
    stem = rep.stem(long_id)
    assert len(stem) == 111 and stem.startswith("tests_test_x.py_test_case_p")   # 100 + "-" + 10 hex
    assert rep.stem(long_id) == stem                                              # stable
    assert len(rep.stem("t" * 120)) == 120                                        # at the cap: kept


# -- 11. the schema: rank below world size; JSON nesting of exactly MAX_DEPTH levels ----------------
def test_rank_equal_to_world_size_is_refused():
    rec = _rank(2, world=3)
    StepRecord.from_dict(json.loads(rec.to_json()))                 # rank 2 of 3: fine
    d = json.loads(rec.to_json())
    d["totals"]["rank"] = 3
    with pytest.raises(RecordError, match=r"totals\.rank"):
        StepRecord.from_dict(d)


def test_json_reader_takes_exactly_max_depth_levels():
    assert MAX_DEPTH == 32

    def nested(levels):                      # the record object is level 1
        inner = "1"
        for _ in range(levels - 1):
            inner = "[" + inner + "]"
        return '{"x": ' + inner + "}"
    assert parse_record(nested(MAX_DEPTH))["x"] is not None
    with pytest.raises(RecordError, match="levels"):
        parse_record(nested(MAX_DEPTH + 1))


# -- 12. the trace draws a module slice inside its phase, never level with it --------------------
def test_module_slices_sit_one_level_below_their_phase():
    model = nn.Sequential(nn.Linear(3, 2))
    with torchledger.trace(model) as t:
        model(torch.ones(4, 3))
    events = [e for e in t.record.to_trace()["traceEvents"] if e.get("ph") == "X"]
    fwd = next(e for e in events if e["cat"] == "phase" and e["name"] == "forward")
    root = next(e for e in events if e["cat"] == "module" and e["name"] == "(root)")
    inner = next(e for e in events if e["cat"] == "module" and e["name"] == "0")
    # every op of this forward runs in module "0": phase, root and "0" start and end together,
    # so only their depth orders them, and a parent must come before its child for the viewer
    assert (fwd["ts"], fwd["dur"]) == (root["ts"], root["dur"]) == (inner["ts"], inner["dur"])
    assert events.index(fwd) < events.index(root) < events.index(inner)
    first_op = next(e for e in events if e["cat"] == "op" and e["ts"] == fwd["ts"])
    assert events.index(inner) < events.index(first_op)


# -- 13. frozen-weight references --------------------------------------------------------------
def _frozen_record(*, trainable=None, world=1, param_bytes=4000):
    rec = StepRecord()
    rec.meta["dtype"] = "float32"
    rec.totals.update(params=1000, param_bytes=param_bytes, world_size=world, rank=0,
                      mesh=[world] if world > 1 else None)
    if trainable is not None:
        rec.totals["trainable_params"] = trainable
    rec.optimizer = {"kind": "adamw", "precision": "fp32"}
    return rec


def test_records_without_trainable_params_have_no_frozen_weights():
    from torchledger.analyzers.compare import _frozen_params
    assert _frozen_params({"params": 1000}) == 0                         # an older record
    assert _frozen_params({"params": 1000, "trainable_params": 600}) == 400


def test_zero3_divides_frozen_weights_over_the_ranks():
    # 600 trainable fp32 AdamW params at 16 B each over 4 ranks = 2,400 B; 400 frozen x 4 B / 4 = 400 B
    rec = _frozen_record(trainable=600, world=4, param_bytes=1000)        # 1,000 B < 0.75 x 4,000: shards
    p = predictions(rec)
    per_gpu = static_memory(600, "adamw", "fp32", gpus=4, zero=3).per_gpu_bytes
    assert per_gpu == 2400
    assert p["static_bytes"] == 2400 + 400 and p["static_bytes_frozen"] == 1600
    single = predictions(_frozen_record(trainable=600))                   # one process: 9,600 + 1,600
    assert single["static_bytes"] == 600 * 16 + 400 * 4


# -- 14/16. Ledger's arguments and its MFU step time ------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "2"])
def test_ledger_refuses_a_sample_every_that_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match="sample_every"):
        torchledger.Ledger(nn.Linear(2, 2), sample_every=bad)


def test_ledger_mfu_uses_the_median_of_the_untraced_times():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt, peak_flops=1e12)
    with ledger.step(tokens=2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    times = [0.9, 0.1, 0.7, 0.3, 0.5]             # its middle entry is 0.7, the median 0.5
    ledger.untraced_seconds[:] = times
    ledger.findings()
    rec = ledger.records[-1]
    flops = rec.totals["flops"]["total"]
    assert rec.totals["mfu"] == pytest.approx(flops / 0.5 / 1e12)
    assert statistics.median(times) == 0.5


# -- 15. the tracer's exit leaves what the step put in place ---------------------------------
def test_modes_the_step_left_above_the_tracer_keep_their_order():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    from torch.utils import _python_dispatch as pd
    flag = pd._is_in_torch_dispatch_mode
    a, b = Passthrough(), Passthrough()
    model = nn.Linear(2, 2)
    base = torch._C._len_torch_dispatch_stack()
    try:
        with torchledger.trace(model):
            a.__enter__()
            b.__enter__()                              # left entered: a below b
        stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
        assert stack[base:] == [a, b]
    finally:
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
        pd._is_in_torch_dispatch_mode = flag     # their exits restore what they saw: ours on
    assert torch._C._len_torch_dispatch_stack() == base


def test_a_sigint_handler_the_step_installed_is_kept():
    def mine(signum, frame):
        pass
    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with torchledger.trace(nn.Linear(2, 2)):
            signal.signal(signal.SIGINT, mine)
        assert signal.getsignal(signal.SIGINT) is mine
        with torchledger.trace(nn.Linear(2, 2)):
            pass
        assert signal.getsignal(signal.SIGINT) is mine            # the handler before the trace
    finally:
        signal.signal(signal.SIGINT, before)
