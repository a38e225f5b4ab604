"""Step-time model, part by part, against hand arithmetic (formulas/steptime.py,
analyzers/steptime.py). Pure arithmetic: no step is traced here except in the last test."""
import math

import pytest

from torchledger.formulas import steptime as st
from torchledger.formulas.hardware import GPUSpec, get_gpu
from torchledger.record import StepRecord

# A made-up part with round numbers: 100 SMs, 100 TFLOP/s bf16, 1 TB/s, NVLink 100 GB/s,
# 8 NICs of 10 GB/s per 8-GPU node; kernels at exactly the model's terms.
PART = GPUSpec("Round", 80e9, 1e12, {"bf16": 100e12, "fp32": 50e12}, (), 100, 100e9, 10e9, 8, 8)
EFF = dict(st.DEFAULT_EFFICIENCY, matmul_peak_fraction=1.0, matmul_tiles=[[128, 128]], matmul_k_tile=64,
           matmul_k_overhead=2.0, matmul_min_intensity=64.0, memory_fraction=1.0, launch_s=5e-6,
           nvlink_fraction=1.0, network_fraction=1.0, sustained_fraction=1.0)


def test_matmul_tiles_waves_and_k_loop_by_hand():
    # 12800 x 1280 x 6400 bf16: 100 x 10 = 1,000 tiles of 128x128 on 100 SMs = 10 full waves;
    # K loop 6400/64 = 100 iterations + 2 overhead; one iteration 2*128*128*64 = 2,097,152
    # FLOPs at 1 TFLOP/s per SM (100 T / 100 SMs; a 128x128 16-bit tile feeds 64 FLOP/B: full
    # rate) = 2.097 us; 10 x 102 x 2.097152 us = 2.1391 ms
    t, tile = st.matmul_fraction(12800, 1280, 6400, 1, "bf16", PART, EFF)
    assert tile == (128, 128, 1)
    assert t == pytest.approx(10 * 102 * 2 * 128 * 128 * 64 / 1e12)
    # the fraction of peak: 2*12800*1280*6400 / 2.1391 ms / 100 T = 100/102 = 98.0%
    flops = 2 * 12800 * 1280 * 6400
    assert flops / t / 100e12 == pytest.approx(100 / 102)


def test_small_and_large_matmuls_get_different_fractions():
    h100 = get_gpu("h100")
    big = st.matmul_seconds(16384, 4096, 4096, 1, "bf16", h100)
    small = st.matmul_seconds(128, 128, 128, 1, "bf16", h100)
    frac_big = 2 * 16384 * 4096 * 4096 / big / h100.peak("bf16")
    frac_small = 2 * 128 ** 3 / small / h100.peak("bf16")
    assert 0.6 < frac_big < 0.8
    assert small == st.efficiency(h100)["launch_s"]     # the launch floor
    assert frac_small < 0.01


def test_wave_quantisation_and_padding():
    # 101 tiles on 100 SMs take 2 waves: as long as 200 tiles
    one = st.matmul_fraction(128 * 101, 128, 64 * 10, 1, "bf16", PART, dict(EFF, matmul_tiles=[[128, 128]]))[0]
    two = st.matmul_fraction(128 * 200, 128, 64 * 10, 1, "bf16", PART, dict(EFF, matmul_tiles=[[128, 128]]))[0]
    assert one == pytest.approx(two)
    # M = 129 pads to two 128-row tiles: as long as M = 256
    a = st.matmul_fraction(129, 128 * 100, 6400, 1, "bf16", PART, EFF)[0]
    b = st.matmul_fraction(256, 128 * 100, 6400, 1, "bf16", PART, EFF)[0]
    assert a == pytest.approx(b)


def test_skinny_matmul_is_memory_bound():
    # 1 x 8192 x 8192 bf16: A 16 KB, B 128 MiB (134,217,728 B), C 16 KB; at 1 TB/s:
    # (16,384 + 134,217,728 + 16,384) / 1e12 = 134.25 us, far above its compute
    t = st.matmul_seconds(1, 8192, 8192, 1, "bf16", PART, EFF)
    assert t == pytest.approx((16384 + 134217728 + 16384) / 1e12)


def test_memory_bound_op_and_launch_floor():
    assert st.memory_seconds(2e9, PART, EFF) == pytest.approx(2e-3)   # 2 GB / 1 TB/s
    assert st.memory_seconds(1e3, PART, EFF) == 5e-6                   # launch floor


def test_ring_all_reduce_alpha_beta_by_hand():
    # 8 ranks in one node, 1 GB: ring Simple latency 8.4 + 2*7 x 3.4 = 56 us; bus bytes
    # 2*7/8 x 1e9 = 1.75e9 at 100 GB/s = 17.5 ms; 17.556 ms
    t, algo = st.collective_seconds("all_reduce", 1e9, 8, 8, PART, EFF)
    assert algo == "ring/Simple"
    assert t == pytest.approx(56e-6 + 1.75e9 / 100e9)


def test_concurrent_groups_share_the_nics():
    # 8x8 mesh, TP inside nodes: an FSDP group of 8 has one rank per node (span 57) and gets
    # one NIC, 10 GB/s; a group of all 64 contiguous ranks gets the node's 8 NICs, 80 GB/s
    assert st.group_layout(8, 57, 8) == (1, 8)
    assert st.bus_bandwidth(8, 57, PART, EFF) == (10e9, "net")
    assert st.bus_bandwidth(64, 64, PART, EFF) == (80e9, "net")
    assert st.bus_bandwidth(8, 8, PART, EFF)[0] == 100e9            # one node: NVLink
    # the DGX H100 figure of the issue: one NIC per FSDP group, 50 GB/s at 90% = 45 GB/s
    assert st.bus_bandwidth(8, 57, get_gpu("h100"))[0] == pytest.approx(45e9)


def test_small_all_reduce_across_many_nodes_takes_the_tree():
    t_ring = st.collective_seconds("all_gather", 1e3, 64, 64, PART, EFF)
    t, algo = st.collective_seconds("all_reduce", 1e3, 512, 512, PART, EFF)
    assert algo.startswith("tree")
    assert t < 2 * 511 * 9.6e-6          # far below a ring's 2(n-1) network steps


def test_fsdp_overlap_with_known_block_times():
    # three blocks, all-gather 2 s, compute 5 s: gather 0-2, compute 2-7; the next gather is
    # issued at 2 (prefetch), done at 4, compute 7-12; the third 7-9, compute 12-17: 17 s
    r = st.overlap_timeline([(2, 5, 0)] * 3)
    assert r["seconds"] == 17 and r["exposed"] == 2
    # gathers longer than compute: 6 s each: 0-6, 6-11 compute; 6-12 gather, 12-17; 12-18, 18-23
    r = st.overlap_timeline([(6, 5, 0)] * 3)
    assert r["seconds"] == 23 and r["exposed"] == 8
    # backward with reduce-scatters of 1 s after each 5 s block: only the last is exposed
    r = st.overlap_timeline([(0, 5, 1)] * 3)
    assert r["seconds"] == 16 and r["exposed"] == 1


def _record(micro=1):
    rec = StepRecord()
    rec.meta["dtype"] = "bfloat16"
    rec.meta["device"] = "fake (cpu)"
    rec.totals.update(tokens=1000, hardware_flops=0, world_size=8)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0}
    if micro > 1:
        rec.totals["micro_batches"] = micro
    rec.modules = [{"name": "", "depth": 0}, {"name": "b0", "depth": 1}, {"name": "b1", "depth": 1}]
    # each block: one elementwise op moving 1 GB: 1 ms forward; 2 GB backward: 2 ms
    rec.ops = [{"op": "aten.add.Tensor", "phase": ph, "module": m, "kind": "elementwise", "count": 1, "flops": 0,
                "bytes_read": n // 2, "bytes_written": n // 2}
               for m in ("b0", "b1") for ph, n in (("forward", 10 ** 9), ("backward", 2 * 10 ** 9))]
    return rec


def test_accumulation_runs_micro_steps_and_one_sync():
    from torchledger.steptime.predict import predict_step_time
    from torchledger.formulas import hardware
    hardware._ensure_loaded()
    part = hardware.register_gpu("Round-test", "80GB", "1TB/s", {"bf16": "100T"}, sm_count=100,
                                 nvlink="100GB/s", nic="10GB/s",
                                 efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0, "overlap_slowdown": 0.0})
    rec = _record()
    # a DDP all-reduce of 700 MB in backward over 8 ranks in one node: 8.4 + 14 x 3.4 = 56 us
    # + 2*7/8 x 0.7e9 / 100e9 = 12.25 ms; issued after the backward's first half (1 bucket:
    # after all of it): fully exposed
    rec.collectives = [{"op": "all_reduce", "phase": "backward", "module": None, "count": 1, "bytes": 7 * 10 ** 8,
                        "algo_bytes": 7 * 10 ** 8, "group_size": 8, "group_span": 8}]
    one = predict_step_time(rec, part)
    comm = 56e-6 + 1.75 * 0.7e9 / 100e9
    assert one["seconds"] == pytest.approx(6e-3 + comm)       # 2 x (1 + 2) ms + the all-reduce
    assert one["comm_exposed_seconds"] == pytest.approx(comm)
    four = predict_step_time(rec, part, {"micro_batches": 4})
    assert four["seconds"] == pytest.approx(4 * 6e-3 + comm)   # 4 micro-steps, one sync
    assert four["tokens_per_s_per_gpu"] == pytest.approx(4000 / four["seconds"])
    assert sum(v for k, v in four["by_kind"].items()) == pytest.approx(four["seconds"])


def test_compiled_fuses_chains():
    from torchledger.steptime.predict import op_seconds
    row = {"op": "aten.mul.Tensor", "kind": "elementwise", "count": 4, "flops": 0, "bytes_read": 4 * 10 ** 9,
           "bytes_written": 4 * 10 ** 9, "fused_bytes": 2 * 10 ** 9, "fused_kernels": 1}
    assert op_seconds(row, PART, EFF)["seconds"] == pytest.approx(8e-3)           # 8 GB eager
    assert op_seconds(row, PART, EFF, compiled=True)["seconds"] == pytest.approx(2e-3)


def test_causal_kernel_runs_slower_per_flop_by_hand():
    """attention_causal_fraction: a causal kernel executes half the pairs at 0.87 of the
    dense kernel's rate per FLOP (FA3 paper Fig. 5, FlashAttention-2 at 4k: 319/368)."""
    # b 1, 32 heads, S 8192, d = dv = 128, bf16, forward, flash [0.65, 0.55] on PART (100 TF/s):
    #   dense FLOPs 2 x 32 x 8192^2 x 256 = 1.09951e12 at 0.65 x 8192 / 8448 = 0.63030 of
    #   100 TF/s -> 17.4442 ms; causal: half of them, 5.49756e11, at 0.63030 x 0.87 = 0.54836
    #   -> 10.0254 ms = 0.5747 of dense (0.5 without the factor)
    assert EFF["attention_causal_fraction"] == 0.87
    dense = st.attention_seconds(1, 32, 8192, 8192, 128, 128, False, False, "bf16", PART, eff=EFF)
    causal = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", PART, eff=EFF)
    assert dense == pytest.approx(17.4442e-3, rel=1e-5)
    assert causal == pytest.approx(10.0254e-3, rel=1e-5)
    assert causal / dense == pytest.approx(0.5 / 0.87, rel=1e-12)
    # the backward the same: 2.5 x the FLOPs at 0.55 x 0.96970 (x 0.87 when causal)
    bd = st.attention_seconds(1, 32, 8192, 8192, 128, 128, False, True, "bf16", PART, eff=EFF)
    bc = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, True, "bf16", PART, eff=EFF)
    assert bd == pytest.approx(2.5 * 1.09951e12 / (100e12 * 0.55 * 8192 / 8448), rel=1e-5)
    assert bc / bd == pytest.approx(0.5 / 0.87, rel=1e-12)
    # a part's row may set it: 1.0 is the dense kernel's rate, exactly half the time
    one = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", PART,
                               eff=dict(EFF, attention_causal_fraction=1.0))
    assert one == pytest.approx(dense / 2, rel=1e-12)


def test_context_parallel_attention_is_priced_as_a_balanced_causal_ring():
    """A cp rank's T/cp queries over the all-gathered T keys ran under a shifted mask (every
    pair computed); on the GPU the ring is load-balanced causal: half the pairs."""
    from torchledger.steptime.predict import op_seconds
    # b 1, 32 heads, 4,096 queries over 8,192 keys, head dim 128, bf16
    row = {"op": "aten._scaled_dot_product_flash_attention_for_cpu.default", "kind": "attention", "count": 1,
           "shapes": [{"attn": [1, 32, 4096, 8192, 128, 128], "dtype": "bf16", "count": 1}]}
    dense = op_seconds(row, PART, EFF)["seconds"]
    ring = op_seconds(row, PART, EFF, cp=2)["seconds"]
    causal = st.attention_seconds(1, 32, 4096, 8192, 128, 128, True, False, "bf16", PART, eff=EFF)
    assert ring == pytest.approx(causal) and ring < dense
    # the same shape with no context parallelism (cross-attention to a longer memory): dense
    assert op_seconds(row, PART, EFF, cp=1)["seconds"] == pytest.approx(dense)
    # queries not T/cp of the keys: not a cp chunk, dense
    row["shapes"][0]["attn"] = [1, 32, 4096, 4096, 128, 128]
    assert op_seconds(row, PART, EFF, cp=2)["seconds"] == pytest.approx(
        st.attention_seconds(1, 32, 4096, 4096, 128, 128, False, False, "bf16", PART, eff=EFF))


# -- calibrate: a fit recovers the parameters synthetic measurements were made with -------------

def _cuda_record(rows, seconds=None):
    rec = StepRecord()
    rec.meta.update(device="cuda:0", dtype="bfloat16")
    rec.totals.update(tokens=1024, hardware_flops=0, step_seconds=seconds)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0}
    rec.ops = rows
    return rec


def _synthetic_records(part):
    """Four steps: a large-matmul one, a memory-bound one, a launch-bound one, an attention one."""
    mm = [{"op": "aten.mm.default", "phase": "forward", "module": "a", "kind": "matmul", "count": 4,
           "flops": 4 * 2 * 8192 ** 3, "shapes": [{"mnk": [1, 8192, 8192, 8192], "dtype": "bf16", "count": 4,
                                                  "flops": 4 * 2 * 8192 ** 3}]}]
    mem = [{"op": "aten.add.Tensor", "phase": "forward", "module": "a", "kind": "elementwise", "count": 10,
            "flops": 0, "bytes_read": 20 * 10 ** 9, "bytes_written": 10 * 10 ** 9}]
    tiny = [{"op": "aten.mul.Tensor", "phase": "forward", "module": "a", "kind": "elementwise", "count": 5000,
             "flops": 0, "bytes_read": 5000 * 1024, "bytes_written": 5000 * 1024}]
    att = [{"op": "aten._scaled_dot_product_flash_attention.default", "phase": "forward", "module": "a",
            "kind": "attention", "count": 8, "flops": 0,
            "shapes": [{"attn": [4, 32, 8192, 8192, 128, 128], "dtype": "bf16", "causal": True, "count": 8,
                        "flops": 0}]}]
    return [mm, mem, tiny, att, mm + mem + tiny + att]


def test_calibrate_recovers_known_parameters(tmp_path):
    from torchledger.steptime.calibrate import fit_efficiency
    from torchledger.steptime.predict import predict_step_time
    from dataclasses import replace
    h100 = get_gpu("h100")
    # the part as whole measured steps run it (no further sustained derate: calibrate's rows)
    truth = {"matmul_peak_fraction": 0.62, "memory_fraction": 0.71, "launch_s": 9e-6, "sustained_fraction": 1.0}
    base = st.efficiency(h100)
    true_att = {k: [f * 0.8 for f in v] for k, v in base["attention"].items()}
    true_part = replace(h100, efficiency={**truth, "attention": true_att})
    records = []
    for rows in _synthetic_records(h100):
        rec = _cuda_record(rows)
        rec.totals["step_seconds"] = predict_step_time(rec, true_part)["seconds"]   # "measured"
        records.append(rec)
    fit = fit_efficiency(records, h100)
    got = fit["efficiency"]
    assert got["matmul_peak_fraction"] == pytest.approx(0.62, rel=0.02)
    assert got["memory_fraction"] == pytest.approx(0.71, rel=0.02)
    assert got["launch_s"] == pytest.approx(9e-6, rel=0.02)
    assert fit["attention_scale"] == pytest.approx(0.8, rel=0.03)
    assert fit["rms_log_error_after"] < 0.01 < fit["rms_log_error_before"]


def test_calibrate_cli_writes_a_hardware_file_and_refuses_fake_records(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from torchledger.cli import cli
    from torchledger.steptime.predict import predict_step_time
    from dataclasses import replace
    h100 = get_gpu("h100")
    true_part = replace(h100, efficiency={"matmul_peak_fraction": 0.6, "sustained_fraction": 1.0})
    paths = []
    for i, rows in enumerate(_synthetic_records(h100)[:1]):
        rec = _cuda_record(rows)
        rec.totals["step_seconds"] = predict_step_time(rec, true_part)["seconds"]
        rec.totals.update(params=1, peak_bytes=1, activation_bytes=0)
        paths.append(rec.save(str(tmp_path / f"r{i}.json")))
    out = tmp_path / "hw.json"
    res = CliRunner().invoke(cli, ["calibrate", *paths, "--gpu", "h100", "--output", str(out)])
    assert res.exit_code == 0, res.output
    import json
    row = json.loads(out.read_text())["H100 SXM"]
    assert row["efficiency"]["matmul_peak_fraction"] == pytest.approx(0.6, rel=0.02)
    fake = _cuda_record(_synthetic_records(h100)[0], 1.0)
    fake.meta["device"] = "fake (cpu)"
    fake.totals.update(params=1, peak_bytes=1, activation_bytes=0)
    res = CliRunner().invoke(cli, ["calibrate", fake.save(str(tmp_path / "fake.json")), "--gpu", "h100",
                                   "--output", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "real CUDA step" in res.output
    assert not (tmp_path / "x.json").exists()


def test_net_finding_uses_the_comm_model():
    from torchledger.analyzers.interconnect import check_comm_time
    from torchledger.steptime.predict import attach_step_time
    rec = _record()
    # 8x8 mesh: an FSDP all-gather of 1 GB over 8 ranks one per node (span 57): one NIC,
    # 50 GB/s x 0.9 on a DGX H100; bus bytes 7/8 GB: 19.4 ms + latency
    rec.collectives = [{"op": "all_gather", "phase": "forward", "module": "b0", "count": 1, "bytes": 125 * 10 ** 6,
                        "algo_bytes": 10 ** 9, "bus_bytes": 875 * 10 ** 6, "group_size": 8, "group_span": 57}]
    attach_step_time(rec, "h100")
    t = rec.collectives[0]["predicted_seconds"]
    assert t == pytest.approx(0.875e9 / 45e9, rel=0.01)
    (f,) = check_comm_time([rec], {"gpu": "h100"})
    assert f.rule == "TL-NET-001" and "19." in f.message and "exposed" in f.message


def test_accumulation_counts_gathers_per_micro_batch_and_the_sync_once():
    from torchledger.steptime.predict import predict_step_time
    part = get_gpu("h100")
    rec = _record()
    rec.collectives = [
        {"op": "all_gather", "phase": "forward", "module": "b0", "count": 1, "bytes": 10 ** 8,
         "algo_bytes": 8 * 10 ** 8, "group_size": 8, "group_span": 8},
        {"op": "reduce_scatter", "phase": "backward", "module": "b0", "count": 1, "bytes": 8 * 10 ** 8,
         "algo_bytes": 8 * 10 ** 8, "group_size": 8, "group_span": 8}]
    one = predict_step_time(rec, part)
    ag = st.collective_seconds("all_gather", 8e8, 8, 8, part)[0]
    rs = st.collective_seconds("reduce_scatter", 8e8, 8, 8, part)[0]
    assert one["comm_seconds"] == pytest.approx(ag + rs)
    four = predict_step_time(rec, part, {"micro_batches": 4})
    assert four["comm_seconds"] == pytest.approx(4 * ag + rs)      # 4 gathers, one reduce-scatter


def test_a_real_cuda_step_shows_predicted_beside_measured():
    from torchledger.steptime.predict import attach_step_time
    from torchledger.render.steptime import step_time_lines
    rec = _record()
    rec.meta["device"] = "cuda:0"
    rec.totals["step_seconds"] = 0.012
    p = attach_step_time(rec, "h100")
    assert p["measured_seconds"] == 0.012
    assert p["predicted_over_measured"] == pytest.approx(p["seconds"] / 0.012)
    assert any("measured 12.0 ms: predicted / measured" in line for line in step_time_lines(rec))


def test_a_part_without_the_steps_dtype_says_so():
    from torchledger.steptime.predict import predict_into
    rec = _record()
    rec.meta["dtype"] = "float32"
    rec.ops.append({"op": "aten.mm.default", "phase": "forward", "module": "b0", "kind": "matmul", "count": 1,
                    "flops": 2 * 64 ** 3, "shapes": [{"mnk": [1, 64, 64, 64], "dtype": "fp32", "count": 1,
                                                      "flops": 2 * 64 ** 3}]})
    predict_into(rec, "b200")          # the B200 row gives no fp32 figure: never another column's
    assert "step_time" not in rec.predictions
    assert any("B200 SXM has no fp32 peak" in w for w in rec.warnings)


def test_pipeline_bubble_from_the_record():
    from torchledger.steptime.predict import predict_step_time
    rec = _record()
    part = get_gpu("h100")
    flat = predict_step_time(rec, part)["seconds"]
    # 4 stages, 8 micro-batches, 1F1B: (p - 1) / (v m) = 3/8 of the compute on top
    rec.totals["pipeline"] = {"stages": 4, "micro_batches": 8, "schedule": "1f1b"}
    p = predict_step_time(rec, part)
    assert p["bubble_seconds"] == pytest.approx(3 / 8 * flat)
    assert p["seconds"] == pytest.approx(flat * 11 / 8)
    rec.totals["pipeline"]["virtual_stages"] = 3                  # interleaved: 3/24
    assert predict_step_time(rec, part)["bubble_seconds"] == pytest.approx(3 / 24 * flat)
    rec.totals["pipeline"]["schedule"] = "zero-bubble"
    assert predict_step_time(rec, part)["bubble_seconds"] == 0


def test_a_composed_pipeline_stage_is_m_micro_steps():
    """A pipeline audit's record (``totals.pipeline.per_stage``) holds one micro-step's ops and
    the step's totals and collectives: the prediction runs its ops m times, its once-only
    collectives once, and divides the step's FLOPs by the step's time (issue 22 x 23: the
    405B stage had one micro-step's time over eighteen's FLOPs, MFU 1.53)."""
    from torchledger.steptime.predict import collective_row_seconds, predict_step_time
    from torchledger.formulas import hardware
    hardware._ensure_loaded()
    part = hardware.register_gpu("Round-pp", "80GB", "1TB/s", {"bf16": "100T"}, sm_count=100,
                                 nvlink="100GB/s", nic="10GB/s",
                                 efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0, "overlap_slowdown": 0.0})
    rec = _record()                   # one micro-step: 2 blocks x (1 ms forward + 2 ms backward)
    rec.totals.update(tokens=4000)    # the step's: 4 micro-batches of 1,000
    rec.totals["flops"] = {"forward": 4 * 10 ** 11, "backward": 8 * 10 ** 11, "optimizer": 0,
                           "total": 12 * 10 ** 11, "other": 0}
    rec.totals["pipeline"] = {"stages": 2, "virtual_stages": 1, "micro_batches": 4, "schedule": "1f1b",
                              "bubble_fraction": 0.25, "per_stage": [{"rank": 0}]}
    gather = {"op": "all_gather", "phase": "forward", "module": "b0", "count": 1, "bytes": 10 ** 8,
              "algo_bytes": 8 * 10 ** 8, "group_size": 8, "group_span": 8, "micro_steps": 1}
    send = {"op": "send", "phase": "forward", "module": None, "count": 4, "bytes": 4 * 10 ** 6,
            "algo_bytes": 4 * 10 ** 6, "group_size": 2, "group_span": 9, "micro_steps": 4}
    rec.collectives = [gather, send]
    g, s = collective_row_seconds(gather, part, st.efficiency(part))[0], collective_row_seconds(
        send, part, st.efficiency(part))[0]
    p = predict_step_time(rec, part)
    assert p["micro_batches"] == 4
    # 4 micro-steps x 6 ms; the gather (first micro-step only) before b0's forward, nothing to
    # hide it under: g exposed once; the sends (the step's 4) exposed; bubble 0.25 x 24 ms
    assert p["seconds"] == pytest.approx(4 * 6e-3 + g + s + 6e-3)
    assert p["bubble_seconds"] == pytest.approx(6e-3)
    assert p["comm_seconds"] == pytest.approx(g + s)                 # the step's rows: not x 4
    assert p["by_phase"]["forward"] == pytest.approx(4 * 2e-3)
    # the step's FLOPs (1.2e12) over the step's time at 100 TFLOP/s; tokens likewise
    assert p["mfu"] == pytest.approx(12e11 / p["seconds"] / 100e12)
    assert p["tokens_per_s_per_gpu"] == pytest.approx(4000 / p["seconds"])
    assert sum(p["by_kind"].values()) == pytest.approx(p["seconds"])


def test_a_composed_stage_reduces_every_micro_step_rows_under_its_backward():
    """A reduction a stage issues in every micro-step (context parallel's K/V gradients) runs
    under that micro-step's backward, a quarter of the row each time; FSDP2's (once) in the last."""
    from torchledger.steptime.predict import collective_row_seconds, predict_step_time
    from torchledger.formulas import hardware
    hardware._ensure_loaded()
    part = hardware.register_gpu("Round-pp2", "80GB", "1TB/s", {"bf16": "100T"}, sm_count=100,
                                 nvlink="100GB/s", nic="10GB/s",
                                 efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0, "overlap_slowdown": 0.0})
    rec = _record()                   # one micro-step: 2 blocks x (1 ms forward + 2 ms backward)
    rec.totals["pipeline"] = {"stages": 2, "micro_batches": 4, "schedule": "zero-bubble", "per_stage": []}
    gathers = [{"op": "all_gather", "phase": "forward", "module": b, "count": 1, "bytes": 10, "algo_bytes": 80,
                "group_size": 8, "group_span": 8, "micro_steps": 1} for b in ("b0", "b1")]
    # b1's reduce-scatter, 4 calls of 1.1e8 B over 8 ranks in a node: ~0.96 ms each
    rs = {"op": "reduce_scatter", "phase": "backward", "module": "b1", "count": 4, "bytes": 44 * 10 ** 7,
          "algo_bytes": 44 * 10 ** 7, "group_size": 8, "group_span": 8, "micro_steps": 4}
    rec.collectives = gathers
    eff = st.efficiency(part)
    g = sum(collective_row_seconds(c, part, eff)[0] for c in gathers)
    base = predict_step_time(rec, part)["seconds"]
    assert base == pytest.approx(4 * 6e-3 + collective_row_seconds(gathers[0], part, eff)[0])
    rec.collectives = gathers + [rs]
    r = collective_row_seconds(rs, part, eff)[0]
    assert 2e-3 < r < 8e-3 and g < 1e-4
    # every micro-step: r / 4 < 2 ms under b0's backward (2 ms): hidden
    assert predict_step_time(rec, part)["seconds"] == pytest.approx(base)
    # once, in the last micro-step: r > 2 ms under b0's backward: r - 2 ms exposed
    rs["micro_steps"] = 1
    assert predict_step_time(rec, part)["seconds"] == pytest.approx(base + r - 2e-3)


def test_tokens_per_s_per_gpu_is_global_tokens_over_the_world():
    """Global tokens / seconds / world size: a rank's tokens are its data-parallel shard's,
    which its tp x pp partners process with it (Llama-3-8B at tp=2 printed 2x the rate)."""
    from torchledger.steptime.predict import predict_step_time
    rec = _record()                                   # 1,000 tokens a rank, world 8
    base = predict_step_time(rec, "h100")
    assert base["tokens_per_s_per_gpu"] == pytest.approx(1000 / base["seconds"])
    # dp=2, tp=2, pp=2: global 2 x 1,000 tokens over 8 GPUs = 1,000 / 4 per GPU per step
    rec.totals["parallel_dims"] = {"dp": 2, "tp": 2, "pp": 2}
    p = predict_step_time(rec, "h100")
    assert p["seconds"] == pytest.approx(base["seconds"])
    assert p["tokens_per_s_per_gpu"] == pytest.approx(1000 / 4 / p["seconds"])
    # cp=2: the rank's tokens are already T/cp of each sequence: dp=4, cp=2 is 1,000 per GPU
    rec.totals["parallel_dims"] = {"dp": 4, "cp": 2}
    assert predict_step_time(rec, "h100")["tokens_per_s_per_gpu"] == pytest.approx(1000 / p["seconds"])


# -- issue 33 item 4: accumulation, pipelines and MFU in the step time ------------------------------

def _round_part(name):
    from torchledger.formulas import hardware
    hardware._ensure_loaded()
    return hardware.register_gpu(name, "80GB", "1TB/s", {"bf16": "100T", "fp32": "50T"}, sm_count=100,
                                 nvlink="100GB/s", nic="10GB/s",
                                 efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0,
                                             "overlap_slowdown": 0.0, "sustained_fraction": 1.0})


def test_tp_collectives_are_paid_once_per_micro_batch_under_accumulation():
    from torchledger.steptime.predict import collective_row_seconds, predict_step_time
    part = _round_part("Round-tp-acc")
    rec = _record()                   # one micro-step: 2 blocks x (1 ms forward + 2 ms backward)
    rec.totals["tensor_parallel"] = 2
    tp = {"op": "all_gather", "phase": "forward", "module": "b0", "count": 1, "bytes": 10 ** 8,
          "algo_bytes": 2 * 10 ** 8, "group_size": 2, "group_span": 2}
    rec.collectives = [tp]
    g = collective_row_seconds(tp, part, st.efficiency(part))[0]
    # 4 micro-batches: 4 x (6 ms of compute + the exposed TP gather), not 4 x 6 ms + one gather
    p = predict_step_time(rec, part, {"micro_batches": 4})
    assert p["seconds"] == pytest.approx(4 * (6e-3 + g))
    assert p["comm_seconds"] == pytest.approx(4 * g)


def test_by_kind_adds_up_with_micro_batches_and_an_optimizer():
    from torchledger.steptime.predict import predict_step_time
    part = _round_part("Round-kinds")
    rec = _record()
    # the optimizer: 3 GB of foreach traffic once per step (3 ms), not once per micro-batch
    rec.ops.append({"op": "aten._foreach_add_.List", "phase": "optimizer", "module": None, "kind": "elementwise",
                    "count": 1, "flops": 0, "bytes_read": 2 * 10 ** 9, "bytes_written": 10 ** 9})
    p = predict_step_time(rec, part, {"micro_batches": 4})
    # 4 x 6 ms of passes + 3 ms of optimizer = 27 ms
    assert p["seconds"] == pytest.approx(27e-3)
    assert p["by_phase"]["optimizer"] == pytest.approx(3e-3)
    assert sum(p["by_kind"].values()) == pytest.approx(p["seconds"])


@pytest.mark.parametrize("schedule, fraction", [("zero-bubble", 0.05), ("gpipe", 0.1875)])
def test_the_records_own_bubble_fraction_is_used(schedule, fraction):
    from torchledger.steptime.predict import predict_step_time
    part = _round_part("Round-bubble")
    rec = _record()
    # p = 4, v = 2, m = 8: the closed form (p-1)/(v m) = 0.1875; the record's schedule says otherwise
    # for zero-bubble (0.05 here, whatever the schedule simulation gave) and the same for GPipe
    rec.totals["pipeline"] = {"stages": 4, "virtual_stages": 2, "micro_batches": 8, "schedule": schedule,
                              "bubble_fraction": fraction}
    p = predict_step_time(rec, part, {"micro_batches": 8})
    # the bubble is the fraction x the step's forward and backward: 8 x 6 ms
    assert p["bubble_seconds"] == pytest.approx(fraction * 8 * 6e-3)


def test_mfu_is_against_the_peak_of_the_dtype_the_matmuls_ran_in():
    from torchledger.steptime.predict import predict_step_time
    part = _round_part("Round-mfu")
    rec = _record()
    rec.meta["dtype"] = "float32"                  # fp32 weights, bf16 autocast matmuls
    flops = 4 * 2 * 8192 ** 3
    rec.ops.append({"op": "aten.mm.default", "phase": "forward", "module": "b0", "kind": "matmul", "count": 4,
                    "flops": flops, "shapes": [{"mnk": [1, 8192, 8192, 8192], "dtype": "bf16", "count": 4,
                                                "flops": flops}]})
    rec.totals["flops"] = {"forward": flops, "backward": 0, "optimizer": 0, "total": flops, "other": 0}
    p = predict_step_time(rec, part)
    # against the bf16 column (100 TFLOP/s), not the fp32 one (50)
    assert p["mfu"] == pytest.approx(flops / p["seconds"] / 100e12)


def test_attention_with_value_head_dim_apart_by_hand():
    """DeepSeek's latent attention: q/k head dim 192 (128 nope + 64 rope), v head dim 128;
    both priced: FLOPs 2 x b x h x sq x sk x (d + dv), bytes Q, O, K and V at their own widths."""
    # compute-bound: b 1, 128 heads, S 4096, bf16, forward, dense: 2 x 128 x 4096^2 x 320
    #   = 1.37439e12 FLOPs at 0.65 x 4096 / 4352 of 100 TF/s (d >= 128: no small-head factor)
    t = st.attention_seconds(1, 128, 4096, 4096, 192, 128, False, False, "bf16", PART, eff=EFF)
    assert t == pytest.approx(2 * 128 * 4096 ** 2 * 320 / (100e12 * 0.65 * 4096 / 4352), rel=1e-12)
    # memory-bound (one query over 4,096 keys): 2 B x 128 heads x (Q 192 + O 128 + K 4096 x 192
    #   + V 4096 x 128) = 2 x 128 x 4097 x 320 = 335,626,240 B at 1 TB/s = 335.626 us (not the
    #   402.7 us of K and V both at 192)
    t = st.attention_seconds(1, 128, 1, 4096, 192, 128, False, False, "bf16", PART, eff=EFF)
    assert t == pytest.approx(335_626_240 / 1e12, rel=1e-12)


def test_interleaved_te_pipeline_hides_p2p_under_the_chunks():
    """Megatron-Core overlaps an interleaved schedule's sends and receives with the chunks'
    compute (overlap_p2p_comm, on whenever virtual stages > 1 in NeMo / Megatron-Bridge); a
    1F1B one batches them and waits, and eager PyTorch's are priced exposed."""
    from torchledger.steptime.predict import collective_row_seconds, predict_step_time
    from torchledger.formulas import hardware
    hardware._ensure_loaded()
    part = hardware.register_gpu("Round-pp3", "80GB", "1TB/s", {"bf16": "100T"}, sm_count=100,
                                 nvlink="100GB/s", nic="10GB/s",
                                 efficiency={"memory_fraction": 1.0, "nvlink_fraction": 1.0, "overlap_slowdown": 0.0})
    rec = _record()                   # one micro-step: 2 blocks x (1 ms forward + 2 ms backward)
    rec.totals["pipeline"] = {"stages": 2, "virtual_stages": 2, "micro_batches": 4, "schedule": "interleaved",
                              "bubble_fraction": 0.0, "per_stage": [{"rank": 0}]}
    send = {"op": "send", "phase": "forward", "module": None, "count": 8, "bytes": 8 * 10 ** 6,
            "algo_bytes": 8 * 10 ** 6, "group_size": 2, "group_span": 9, "micro_steps": 4}
    rec.collectives = [send]
    s = collective_row_seconds(send, part, st.efficiency(part))[0]
    assert 1e-3 < s < 24e-3                       # 8 MB over a 10 GB/s NIC, under the 24 ms of compute
    eager = predict_step_time(rec, part)["seconds"]
    assert eager == pytest.approx(4 * 6e-3 + s)                          # exposed
    te = predict_step_time(rec, part, {"kernels": "te"})
    passes = te["by_phase"]["forward"] + te["by_phase"]["backward"]
    assert te["comm_exposed_seconds"] == pytest.approx(0, abs=1e-12) and s < passes
    assert te["seconds"] == pytest.approx(passes + te["by_phase"].get("optimizer", 0) + te["by_phase"].get("other", 0))
    assert any("overlap_p2p_comm" in a for a in te["assumptions"])
    # more p2p than compute: the rest exposed
    send.update(count=80, bytes=8 * 10 ** 8, algo_bytes=8 * 10 ** 8)
    big = collective_row_seconds(send, part, st.efficiency(part))[0]
    te_big = predict_step_time(rec, part, {"kernels": "te"})
    assert big > passes and te_big["comm_exposed_seconds"] == pytest.approx(big - passes, rel=1e-6)
    # 1F1B under te (batch_p2p_comm): exposed
    rec.totals["pipeline"].update(virtual_stages=1, schedule="1f1b")
    send.update(count=8, bytes=8 * 10 ** 6, algo_bytes=8 * 10 ** 6)
    assert predict_step_time(rec, part, {"kernels": "te"})["comm_exposed_seconds"] == pytest.approx(s)
