"""``--kernels eager|compiled|te``, ``--precision fp8``, the sustained-training terms of the
time model and the flags that describe a Megatron / NeMo run (``--precision bf16-params``,
``--checkpointing selective-attention``), each against hand arithmetic on a round part."""
import json
import os

import pytest
from click.testing import CliRunner

from torchledger.steptime.predict import fp8_row, predict_step_time
from torchledger.formulas import hardware
from torchledger.formulas import steptime as st
from torchledger.record import StepRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "gpt2_tiny.py")
GB = 10 ** 9


@pytest.fixture(scope="module")
def part():
    """100 SMs, 100 TFLOP/s bf16 (200 fp8), 1 TB/s at 100% (1 GB = 1 ms), NVLink 100 GB/s at
    100%; cuDNN attention 0.9 / 0.8 of peak, FlashAttention 0.5 / 0.4; no sustained derate
    and no slowdown under collectives."""
    hardware._ensure_loaded()
    return hardware.register_gpu(
        "Round-kernels", "80GB", "1TB/s", {"bf16": "100T", "fp8": "200T"}, sm_count=100, nvlink="100GB/s",
        nic="10GB/s", efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0, "sustained_fraction": 1.0,
                                  "overlap_slowdown": 0.0,
                                  "attention": {"flash": [0.5, 0.4], "cudnn": [0.9, 0.8]}})


def _record(rows, collectives=(), **totals) -> StepRecord:
    rec = StepRecord()
    rec.meta.update(dtype="bfloat16", device="fake (cpu)")
    rec.totals.update(tokens=1000, hardware_flops=0, world_size=8, **totals)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0}
    rec.modules = [{"name": "", "depth": 0}, {"name": "layers.0", "depth": 1}]
    rec.ops = list(rows)
    rec.collectives = list(collectives)
    return rec


def _elementwise(phase):
    # 4 kernels moving 8 GB eagerly (8 ms); one fused chain moving 2 GB (2 ms)
    return {"op": "aten.mul.Tensor", "phase": phase, "module": "layers.0", "kind": "elementwise", "count": 4,
            "flops": 0, "bytes_read": 4 * GB, "bytes_written": 4 * GB, "fused_bytes": 2 * GB, "fused_kernels": 1}


def test_compiled_fuses_the_model_not_the_optimizer_and_te_fuses_both(part):
    rec = _record([_elementwise("forward"), _elementwise("optimizer")])
    eager = predict_step_time(rec, part, {"kernels": "eager"})["by_phase"]
    assert eager["forward"] == pytest.approx(8e-3) and eager["optimizer"] == pytest.approx(8e-3)
    # torch.compile of the model: the forward's chain fused (2 ms), the optimizer step eager
    compiled = predict_step_time(rec, part, {"kernels": "compiled"})["by_phase"]
    assert compiled["forward"] == pytest.approx(2e-3) and compiled["optimizer"] == pytest.approx(8e-3)
    assert predict_step_time(rec, part, {"compiled": True})["by_phase"] == compiled
    # Transformer Engine: fused norm/activation kernels and fused Adam
    te = predict_step_time(rec, part, {"kernels": "te"})
    assert te["by_phase"]["forward"] == pytest.approx(2e-3) and te["by_phase"]["optimizer"] == pytest.approx(2e-3)
    assert any(a.startswith("kernels te") for a in te["assumptions"])
    # the audit's --kernels, read from the record when no option says otherwise
    rec.meta["audit"] = {"kernels": "compiled"}
    assert predict_step_time(rec, part)["by_phase"] == compiled


def test_te_distributed_optimizer_steps_one_replicas_shard(part):
    rec = _record([_elementwise("optimizer")], parallel_dims={"dp_replicate": 4})
    # fused Adam 2 ms, each of 4 replicas updating a quarter: 0.5 ms
    assert predict_step_time(rec, part, {"kernels": "te"})["by_phase"]["optimizer"] == pytest.approx(0.5e-3)
    assert predict_step_time(rec, part, {"kernels": "eager"})["by_phase"]["optimizer"] == pytest.approx(8e-3)


def test_te_prices_attention_as_cudnn(part):
    row = {"op": "aten._scaled_dot_product_flash_attention_for_cpu.default", "phase": "forward",
           "module": "layers.0", "kind": "attention", "count": 1,
           "shapes": [{"attn": [1, 32, 8192, 8192, 128, 128], "dtype": "bf16", "causal": True, "count": 1}]}
    rec = _record([row])
    # causal: 2 x 32 x 8192^2 x 256 / 2 = 2.2e12 FLOPs; at 0.9 x 100 T x 8192 / (8192 + 256)
    # x 0.87 (a causal kernel's rate per executed FLOP): 7.2406 ms
    flops = 2 * 32 * 8192 ** 2 * 256 / 2
    te = predict_step_time(rec, part, {"kernels": "te"})["by_kind"]["attention"]
    assert te == pytest.approx(flops / (100e12 * 0.9 * 8192 / (8192 + 256) * 0.87))
    assert te == pytest.approx(7.2406e-3, rel=1e-4)
    eager = predict_step_time(rec, part, {"kernels": "eager"})["by_kind"]["attention"]
    assert eager == pytest.approx(te * 0.9 / 0.5)


def _tp_collective(op, phase="forward"):
    # 100 MB over the 2 tp ranks of one node
    return {"op": op, "phase": phase, "module": "layers.0", "count": 1, "bytes": 10 ** 8, "algo_bytes": 10 ** 8,
            "group_size": 2, "group_span": 2}


def _big_matmul():
    # 8192^3 x 4 calls in bf16: 4 x 1.1e12 FLOPs, milliseconds of tensor-core work
    return {"op": "aten.mm.default", "phase": "forward", "module": "layers.0", "kind": "matmul", "count": 4,
            "flops": 4 * 2 * 8192 ** 3,
            "shapes": [{"mnk": [1, 8192, 8192, 8192], "dtype": "bf16", "count": 4, "flops": 4 * 2 * 8192 ** 3}]}


def test_te_overlaps_sequence_parallel_collectives_not_all_reduces(part):
    from torchledger.steptime.predict import collective_row_seconds
    eff = st.efficiency(part)
    ag = _tp_collective("all_gather")
    ar = _tp_collective("all_reduce")
    ag_s, ar_s = collective_row_seconds(ag, part, eff)[0], collective_row_seconds(ar, part, eff)[0]
    rec = _record([_big_matmul()], [ag, ar], tensor_parallel=2)
    eager = predict_step_time(rec, part, {"kernels": "eager"})
    te = predict_step_time(rec, part, {"kernels": "te"})
    # eager: both exposed; te: the all-gather (SP) under the 8192^3 GEMMs, the all-reduce exposed
    assert eager["seconds"] - te["seconds"] == pytest.approx(ag_s)
    assert te["comm_exposed_seconds"] == pytest.approx(ar_s)


def test_fp8_rows_of_the_blocks_by_hand(part):
    row = _big_matmul()
    row["module"] = "model.layers.3.mlp.up_proj"
    got, casts = fp8_row(row)
    # each of 4 GEMMs casts A and B (8192 x 8192 each) from bf16: 3 B x 4 x 2 x 8192^2
    assert casts == 3 * 4 * 2 * 8192 ** 2 and got["shapes"][0]["dtype"] == "fp8"
    head = dict(row, module="lm_head")
    assert fp8_row(head) == (head, 0.0)
    # priced: the GEMMs at the fp8 peak (half the bf16 time: compute-bound 8192^3), the casts
    # at 1 TB/s: 805,306,368 B = 0.805 ms
    rec = _record([row])
    bf16 = predict_step_time(rec, part)
    rec.meta["audit"] = {"precision": "fp8"}
    fp8 = predict_step_time(rec, part)
    assert fp8["by_kind"]["matmul"] == pytest.approx(bf16["by_kind"]["matmul"] / 2, rel=1e-3)
    assert fp8["by_kind"]["memory_bound"] == pytest.approx(3 * 4 * 2 * 8192 ** 2 / 1e12)


def test_fp8_on_a_part_without_fp8_tensor_cores_is_priced_16_bit_and_said():
    # an A100 has no fp8 column: no casts, the bf16 GEMM time, and a line that says so
    row = _big_matmul()
    row["module"] = "layers.0.mlp.up_proj"
    rec = _record([row])
    bf16 = predict_step_time(rec, "a100")
    rec.meta["audit"] = {"precision": "fp8"}
    got = predict_step_time(rec, "a100")
    assert got["seconds"] == pytest.approx(bf16["seconds"])
    assert any("no fp8 tensor cores" in a for a in got["assumptions"])


def test_sustained_fraction_and_overlap_slowdown(part):
    import dataclasses
    eff = dict(st.efficiency(part))
    one = st.matmul_seconds(8192, 8192, 8192, 1, "bf16", part, eff)
    half = st.matmul_seconds(8192, 8192, 8192, 1, "bf16", part, dict(eff, sustained_fraction=0.5))
    assert half == pytest.approx(2 * one)
    a1 = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", part, eff=eff)
    a2 = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", part,
                              eff=dict(eff, sustained_fraction=0.5))
    assert a2 == pytest.approx(2 * a1)
    # FSDP2 units layers.0 and layers.1, each 8 ms of forward compute and a 100 MB all-gather
    # over 8 ranks (g): layers.0's gather has nothing to hide under (exposed), layers.1's is
    # prefetched under layers.0's compute (hidden); with overlap_slowdown 0.2 the compute
    # under it takes 0.2 x g longer
    from torchledger.steptime.predict import collective_row_seconds
    rows, gathers = [], []
    for unit in ("layers.0", "layers.1"):
        rows.append(dict(_elementwise("forward"), module=unit))
        gathers.append({"op": "all_gather", "phase": "forward", "module": unit, "count": 1, "bytes": 10 ** 8,
                        "algo_bytes": 8 * 10 ** 8, "group_size": 8, "group_span": 8})
    rec = _record(rows, gathers)
    rec.modules.append({"name": "layers.1", "depth": 1})
    g = collective_row_seconds(gathers[1], part, st.efficiency(part))[0]
    base = predict_step_time(rec, part)
    assert base["seconds"] == pytest.approx(g + 16e-3) and base["comm_exposed_seconds"] == pytest.approx(g)
    slow = dataclasses.replace(part, efficiency={**part.efficiency, "overlap_slowdown": 0.2})
    got = predict_step_time(rec, slow)
    assert got["seconds"] - base["seconds"] == pytest.approx(0.2 * g)
    assert got["by_kind"]["comm_contention"] == pytest.approx(0.2 * g)
    assert sum(got["by_kind"].values()) == pytest.approx(got["seconds"])


def test_the_500w_h100_part():
    gpu = hardware.get_gpu("h100-96gb-500w")
    assert gpu.memory_bytes == 95 * 2**30 and gpu.bandwidth_bytes_per_s == pytest.approx(2.46e12)
    eff = st.efficiency(gpu)
    # (500 / 700)^(1/3) = 0.894 of the 700 W part's matmul and attention fractions
    assert round((500 / 700) ** (1 / 3), 3) == 0.894
    h100 = st.efficiency(hardware.get_gpu("h100"))
    assert eff["matmul_peak_fraction"] == pytest.approx(h100["matmul_peak_fraction"] * 0.894, abs=1e-4)
    assert eff["attention"]["cudnn"][0] == pytest.approx(h100["attention"]["cudnn"][0] * 0.894, abs=1e-4)


# -- the flags on a real audit --------------------------------------------------------------------

def _audit(tmp_path, *args):
    from torchledger.cli import cli
    out = tmp_path / "a.json"
    res = CliRunner().invoke(cli, ["audit", TINY, "--steps", "2", *args, "--format", "json", "--output", str(out)])
    return res, (json.loads(out.read_text()) if out.exists() else None)


def test_compiled_and_kernels_te_together_is_one_line(tmp_path):
    from test_audit_cli import one_line_error
    res, _ = _audit(tmp_path, "--compiled", "--kernels", "te")
    one_line_error(res, "--compiled and --kernels te", "give one")


@pytest.mark.parametrize("precision,dtype", [("bf16-params", "bfloat16"), ("fp16-params", "float16"),
                                             ("fp8", "bfloat16")])
def test_sixteen_bit_weights_with_fp32_masters(tmp_path, precision, dtype):
    res, d = _audit(tmp_path, "--precision", precision, "--gpu", "h100")
    assert res.exit_code in (0, 1), res.output
    n = d["totals"]["trainable_params"]
    assert d["meta"]["dtype"] == dtype
    # weights and gradients 2 B a parameter, fp32 masters 4 B, AdamW's two fp32 moments 8 B
    assert d["totals"]["param_bytes"] == 2 * n and d["totals"]["grad_bytes"] == 2 * n
    assert d["optimizer"]["master_weight_bytes"] == 4 * n and d["optimizer"]["precision"] == "mixed"
    assert 8 * n <= d["optimizer"]["state_bytes"] <= 8 * n + 4 * 64       # + a step scalar per tensor
    row = next(c for c in d["predictions"]["comparisons"] if c["quantity"].startswith("static bytes"))
    assert row["predicted"] == 16 * n and abs(row["ratio"] - 1) < 0.001
    assert d["meta"]["audit"]["precision"] == precision
    if precision == "fp8":
        assert any("fp8: the blocks' linear-layer GEMMs" in a for a in d["predictions"]["step_time"]["assumptions"])


def test_selective_attention_recomputes_the_attention_core_only(tmp_path):
    res, d = _audit(tmp_path, "--checkpointing", "selective-attention", "--kernels", "te", "--gpu", "h100")
    assert res.exit_code in (0, 1), res.output
    recompute = [r for r in d["ops"] if r["phase"] == "recompute"]
    # one attention forward per block (gpt2-tiny: 2 blocks) and nothing else that computes
    attention = [r for r in recompute if "attention" in r["op"]]
    assert sum(r["count"] for r in attention) == 2
    assert not [r for r in recompute if r.get("kind") == "matmul"]
    assert d["meta"]["audit"]["kernels"] == "te"
    res, none = _audit(tmp_path, "--checkpointing", "none")
    assert d["totals"]["activation_bytes"] < none["totals"]["activation_bytes"]


@pytest.mark.parametrize("precision", ["bf16-params", "bf16-mixed"])
def test_distributed_optimizer_splits_masters_and_state_over_the_replicas(tmp_path, precision):
    """--kernels te with dp_replicate: Megatron's distributed optimizer. Each replica's optimizer
    holds the first ceil(n/4) elements of every parameter: fp32 master shards of 16-bit weights
    (4 + 16/d bytes a parameter), or views of fp32 weights (8 + 8/d), never the whole state."""
    flags = ("--gpu", "h100", "--world-size", "4", "--mesh", "dp_replicate=4", "--precision", precision)
    res, d = _audit(tmp_path, *flags, "--kernels", "te")
    assert res.exit_code in (0, 1), res.output
    res, whole = _audit(tmp_path, *flags)
    assert res.exit_code in (0, 1), res.output
    n = d["totals"]["trainable_params"]
    opt = d["optimizer"]
    assert opt["shards"] == 4 and "shards" not in whole["optimizer"]
    k = next(e for e in opt["state"] if e["key"] == "exp_avg")["tensors"]
    shard = next(e for e in opt["state"] if e["key"] == "exp_avg")["numel"]
    assert n / 4 <= shard <= n / 4 + k              # each tensor's ceil(n_i / 4)
    assert opt["params"] == shard
    assert next(e for e in whole["optimizer"]["state"] if e["key"] == "exp_avg")["numel"] == n
    # the weights and their gradients stay whole on every replica
    assert d["totals"]["param_bytes"] == whole["totals"]["param_bytes"]
    if precision == "bf16-params":
        assert opt["master_weight_bytes"] == 4 * shard and whole["optimizer"]["master_weight_bytes"] == 4 * n
    else:
        assert opt["master_weight_bytes"] == 0      # the fp32 weights are their own masters
    row = next(c for c in d["predictions"]["comparisons"] if c["quantity"].startswith("static bytes"))
    assert abs(row["ratio"] - 1) < 0.001 and "distributed optimizer splits" in row["explanation"]
    # DDP alone divides nothing: the sentence names the params without an empty list before them
    plain = next(c for c in whole["predictions"]["comparisons"] if c["quantity"].startswith("static bytes"))
    assert f"this rank's shares: {n:,} params on this rank" in plain["explanation"]
    assert d["totals"]["peak_bytes"] < whole["totals"]["peak_bytes"]
    assert any("distributed optimizer" in line for line in d["meta"]["audit"]["plan"])
    # the traced step ran 1/4 of the update: priced as traced, not divided again (a record
    # without ``optimizer.shards``, traced whole, is the one the pricing divides)
    from torchledger.record.core import StepRecord
    from torchledger.steptime.predict import predict_step_time
    rec = StepRecord.from_dict(d)
    split = predict_step_time(rec, "h100")["by_phase"]["optimizer"]
    assert split == pytest.approx(d["predictions"]["step_time"]["by_phase"]["optimizer"], rel=1e-9)
    del rec.optimizer["shards"]
    assert predict_step_time(rec, "h100")["by_phase"]["optimizer"] == pytest.approx(split / 4, rel=1e-9)
