"""Closed forms of torchledger.formulas, checked by hand and against ACCOUNTING.md."""
import json
import math

import pytest

from torchledger import formulas as an
from torchledger.formulas import activations, flops, hardware, inference, memory
from torchledger.models.config import CruncherConfig, TransformerConfig, get_config
from torchledger.units import GB, GiB


# ----------------------------------------------------------------------------- params


def test_tiny_transformer_counted_by_hand():
    cfg = TransformerConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1,
                            d_ff=8, mlp="gelu", norm="layernorm", bias=True,
                            tie_embeddings=False, n_positions=3)
    c = an.count_params(cfg)
    # d_h = 2, kv_dim = 1*2 = 2. q, o: 4*4 each; k, v: 4*2 each -> 32 + 16 = 48 weights;
    # biases q 4 + k 2 + v 2 + o 4 = 12.
    assert c.per_layer["attention"] == 48 + 12
    # up 4*8 + down 8*4 = 64 weights; biases 8 + 4 = 12.
    assert c.per_layer["mlp"] == 64 + 12
    # two LayerNorms with bias: 2 * (4 + 4).
    assert c.per_layer["norms"] == 16
    assert c.breakdown == {"embeddings": 40, "positions": 12, "attention": 60, "mlp": 76,
                           "norms": 16, "final_norm": 8, "lm_head": 40}
    assert c.total == 40 + 12 + 60 + 76 + 16 + 8 + 40 == 252
    # matmul N: attention 48 + mlp 64 + LM head 40 = 152 (no lookups, norms, biases).
    assert c.matmul == 152
    # 12*L*d^2 + V*d = 12*1*16 + 40 = 232.
    assert c.approx_12ld2 == 232 and c.blocks_12ld2 == 192
    assert c.approx_rel_error == pytest.approx((232 - 252) / 252)


def test_tied_head_counted_once_but_multiplies():
    tied = an.count_params(TransformerConfig(vocab_size=7, d_model=4, n_layers=1, n_heads=1,
                                             bias=False, norm="rmsnorm"))
    untied = an.count_params(TransformerConfig(vocab_size=7, d_model=4, n_layers=1, n_heads=1,
                                               bias=False, norm="rmsnorm",
                                               tie_embeddings=False))
    assert tied.breakdown["lm_head"] == 0 and untied.breakdown["lm_head"] == 7 * 4
    assert untied.total - tied.total == 28
    assert tied.matmul == untied.matmul          # the head multiplies either way


def test_swiglu_rmsnorm_no_bias():
    cfg = TransformerConfig(vocab_size=5, d_model=8, n_layers=2, n_heads=2, d_ff=6,
                            mlp="swiglu", norm="rmsnorm", bias=False)
    c = an.count_params(cfg)
    assert c.per_layer == {"attention": 4 * 64, "mlp": 3 * 8 * 6, "norms": 2 * 8}
    assert c.breakdown["final_norm"] == 8


def test_cruncher_params():
    # D*D*num_layers + D = 128*128*4 + 128
    c = an.count_params(CruncherConfig(dim=128, num_layers=4))
    assert c.total == c.matmul == 65_664
    assert c.approx_12ld2 is None and c.approx_rel_error is None


@pytest.mark.parametrize("name, exact", [("gpt2", 124_439_808), ("llama2-7b", 6_738_415_616),
                                         ("llama3-8b", 8_030_261_248)])
def test_worked_exact_counts(name, exact):
    assert an.count_params(get_config(name)).total == exact


def test_llama2_7b_spelled_out():
    c = an.count_params(get_config("llama2-7b"))
    assert c.per_layer == {"attention": 67_108_864, "mlp": 135_266_304, "norms": 8_192}
    assert 32 * (67_108_864 + 135_266_304 + 8_192) + 2 * 131_072_000 + 4_096 == c.total


@pytest.mark.parametrize("d, L, billions", [(4096, 32, 6.4), (5120, 40, 12.6), (8192, 80, 64.4)])
def test_12ld2_worked(d, L, billions):
    assert round(an.params_12ld2(d, L) / 1e9, 1) == billions


def test_component_shares():
    # GPT-2 small: embeddings (token + position) about a third; Llama 2 70B: MLP > 80%.
    gpt2 = an.count_params(get_config("gpt2")).shares()
    assert 0.30 < gpt2["embeddings"] + gpt2["positions"] < 0.34
    assert an.count_params(get_config("llama2-70b")).shares()["mlp"] > 0.80


def test_count_params_rejects_other_types():
    with pytest.raises(TypeError, match="TransformerConfig"):
        an.count_params({"d_model": 4})


# ----------------------------------------------------------------------------- flops


def test_6nd_exact_ints():
    assert an.training_flops(175e9, 300e9) == 315 * 10**21       # 6*175e9*300e9
    assert an.training_flops(70e9, 15e12) == 63 * 10**23
    assert isinstance(an.training_flops(7e9, 1e12), int)
    assert flops.exact(8.03 * 1e9) == 8_030_000_000               # float noise of '8.03B'
    assert flops.exact(2.5) == 2.5


def test_attention_term_dense_and_causal():
    # 12*L*T*d per token; forward only 4*L*T*d; causal exactly half.
    assert an.attention_flops_per_token(2, 8, 4) == 12 * 2 * 8 * 4 == 768
    assert an.attention_flops_per_token(2, 8, 4, training=False) == 256
    assert an.attention_flops_per_token(2, 8, 4, causal=True) == 384
    # Ratio to 6N with N = 12Ld^2 is T/(6d): d=4096, T=4096 -> 1/6, about 17%.
    L, d, T = 32, 4096, 4096
    ratio = an.attention_flops_per_token(L, T, d) / (6 * an.params_12ld2(d, L))
    assert round(ratio, 2) == 0.17


def test_training_time_worked():
    c = an.training_flops(70e9, 15e12)
    h100 = an.get_gpu("h100").peak("bf16")
    assert round(an.training_time(c, peak_flops=h100, gpus=1024, mfu=0.5).days) in (143, 144)
    assert round(an.training_time(c, peak_flops=1e15, gpus=1024, mfu=0.5).days) == 142
    # ~204 days at MFU 0.35: 203.4 (1e15 peak) to 205.6 (989.5 TF); ACCOUNTING rounds 143/0.7.
    assert abs(an.training_time(c, peak_flops=1e15, gpus=1024, mfu=0.35).days - 204) < 1
    gpt3 = an.training_time(an.training_flops(175e9, 300e9), peak_flops=h100, mfu=0.4)
    assert round(gpt3.gpu_hours, -4) == 2.2e5


def test_training_time_cost_and_gpu_hours():
    # 3.6e15 FLOPs at 1e12 FLOP/s * 2 GPUs * 0.5 MFU = 3600 s = 1 h wall, 2 GPU-hours.
    t = an.training_time(3.6e15, peak_flops=1e12, gpus=2, mfu=0.5, price_per_gpu_hour=3.0)
    assert t.seconds == pytest.approx(3600) and t.gpu_hours == pytest.approx(2)
    assert t.cost == pytest.approx(6.0)
    assert an.training_time(3.6e15, peak_flops=1e12).cost is None
    with pytest.raises(ValueError, match="mfu"):
        an.training_time(1, peak_flops=1, mfu=1.5)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("optimizer, precision, total", [
    ("adamw", "fp32", 16), ("adamw", "mixed", 16), ("adam8bit", "mixed", 10),
    ("sgd", "fp32", 8), ("sgd-momentum", "fp32", 12), ("adagrad", "fp32", 12),
    ("rmsprop", "fp32", 12), ("adam", "bf16", 8), ("sgd", "bf16", 4), ("adam8bit", "fp32", 10),
])
def test_bytes_per_param(optimizer, precision, total):
    assert sum(an.bytes_per_param(optimizer, precision).values()) == total


def test_bytes_per_param_table_rows():
    assert an.bytes_per_param("adamw", "fp32") == {"params": 4, "grads": 4, "master": 0,
                                                   "optimizer": 8}
    assert an.bytes_per_param("adamw", "mixed") == {"params": 2, "grads": 2, "master": 4,
                                                    "optimizer": 8}
    assert an.bytes_per_param("adam8bit", "mixed")["optimizer"] == 2
    with pytest.raises(ValueError, match="adamw"):
        an.bytes_per_param("lion")


@pytest.mark.parametrize("n, gb", [(1e9, 16), (7e9, 112), (13e9, 208), (30e9, 480),
                                   (70e9, 1120)])
def test_static_memory_worked(n, gb):
    assert an.static_memory(n).total_bytes == gb * GB


def test_zero_stages_per_gpu():
    # 16 B/param mixed AdamW, 8 GPUs: stage 1 shards master 4 + optimizer 8 -> 2+2+12/8 = 5.5;
    # stage 2 also grads -> 2 + 14/8 = 3.75; stage 3 everything -> 16/8 = 2.
    per = {z: an.static_memory(1000, "adamw", "mixed", gpus=8, zero=z).per_gpu_bytes
           for z in range(4)}
    assert per == {0: 16000, 1: 5500, 2: 3750, 3: 2000}
    # ZeRO-3 of 7.5B over 64 GPUs: 16*7.5e9/64 = 1.875e9 B, about 1.9 GB each.
    m = an.static_memory(7.5e9, gpus=64, zero=3)
    assert m.per_gpu_bytes == 1.875e9 and round(m.per_gpu_bytes / GB, 1) == 1.9


def test_max_params():
    assert an.max_params(80 * GB, gpus=8, zero=3) == 40 * 10**9     # 640 GB / 16
    assert an.max_params(80 * GB, gpus=8, zero=0) == 5 * 10**9      # 80 GB / 16
    m = an.static_memory(7e9, gpus=8, zero=3)
    assert memory.fits(m, 80 * GB) is True and memory.fits(m, None) is None


def test_llama3_8b_memory_worked():
    n = 8_030_261_248
    assert round(an.weight_bytes(n, "fp32") / GiB, 1) == 29.9
    assert round(an.weight_bytes(n, "bf16") / GiB, 1) == 15.0
    assert round(an.weight_bytes(n, "int8") / GiB, 1) == 7.5
    assert round(an.weight_bytes(n, "int4") / GiB, 1) == 3.7
    assert round(an.static_memory(n, "adamw").total_bytes / GiB) == 120
    assert round(an.static_memory(n, "adam8bit", "mixed").total_bytes / GiB) == 75


def test_naive_fp32_training():
    # 4 * (3*Np + Na): 10 params, 5 activations -> 4 * 35 = 140 bytes
    assert memory.naive_fp32_training_bytes(10, 5) == 140


# ----------------------------------------------------------------------------- activations


def test_korthikanti_by_hand():
    # s=2, b=3, h=4, a=2: s*b*h*(34 + 5*a*s/h) = 24 * (34 + 5) = 936
    assert an.korthikanti_layer_bytes(2, 3, 4, 2) == 936
    assert an.korthikanti_layer_bytes(2, 3, 4, 2, fused_attention=True) == 24 * 34
    assert activations.tensor_bytes(3, 2, 4) == 2 * 3 * 2 * 4


def test_activation_recompute_modes():
    full = an.activation_memory(2, 3, 4, 2, 5)
    assert full.saved_bytes == 5 * 936
    inputs = an.activation_memory(2, 3, 4, 2, 5, recompute="full")
    assert inputs.saved_bytes == 5 * 2 * 2 * 3 * 4               # 2*s*b*h per layer
    assert inputs.peak_bytes == inputs.saved_bytes + 936
    with pytest.raises(ValueError, match="recompute"):
        an.activation_memory(2, 3, 4, 2, 5, recompute="half")


def test_sqrt_checkpointing_worked():
    # 80 layers of 200 MB: 16 GB without, sqrt(80) * 200 MB ~ 1.8 GB with.
    kept, _ = activations._saved(200 * 10**6, 0, 80, "sqrt")
    assert 80 * 200 * 10**6 == 16 * GB and round(kept / GB, 1) == 1.8


# ----------------------------------------------------------------------------- inference


def test_kv_cache_worked():
    kv = an.kv_cache(80, 8, 128, 32768)
    assert kv.bytes_per_token == 327_680 == 320 * 1024             # 2*80*8*128*2
    assert kv.total_bytes == 10 * GiB
    assert an.kv_cache(80, 64, 128, 32768).total_bytes == 80 * GiB
    assert an.kv_cache(1, 1, 4, 3, batch=2, dtype="fp32").total_bytes == 2 * 4 * 4 * 3 * 2
    with pytest.raises(ValueError, match="bf16"):
        an.kv_cache(1, 1, 1, 1, dtype="int3")


def test_decode_worked_llama3_8b():
    count = an.count_params(get_config("llama3-8b"))
    d = an.decode_step(count.total, "h100", matmul_params=count.matmul)
    assert round(d.weight_bytes / GB, 1) == 16.1                   # 2 * 8.03e9
    assert round(d.ms_per_step, 2) == 4.79                         # 16.06e9 / 3.35e12
    assert round(d.compute_s * 1e6, 1) == 15.2                     # 2 * 7.50e9 / 989.5e12
    assert round(d.tokens_per_s) == 209
    # ACCOUNTING: "~315" = 4.79 ms / 15.2 us; unrounded it is 316.06.
    assert d.critical_batch == pytest.approx(4.79e-3 / 15.2e-6, rel=0.005)
    assert d.bound == "memory"


def test_decode_compute_bound_past_critical_batch():
    # 1e9 weights bf16 at 1e12 B/s: 2 ms; compute 2*1e9*B / 1e15 = 2 us * B -> critical 1000.
    d = an.decode_step(1e9, peak_flops=1e15, bandwidth=1e12, batch=2000)
    assert d.critical_batch == pytest.approx(1000)
    assert d.bound == "compute" and d.step_s == pytest.approx(4e-3)
    assert d.tokens_per_s == pytest.approx(2000 / 4e-3)
    with pytest.raises(ValueError, match="gpu"):
        inference.decode_step(1e9)


# ----------------------------------------------------------------------------- hardware


@pytest.mark.parametrize("name", ["h100", "H100", "H100-SXM", "h100_sxm5", "NVIDIA H100",
                                  "h100-80gb"])
def test_gpu_aliases(name):
    assert an.get_gpu(name).name == "H100 SXM"


def test_hardware_table():
    h100 = an.get_gpu("h100")
    # the runtime's total for an "80 GB" H100 (79.18 GiB), not the datasheet's 80e9
    assert h100.memory_bytes == 79.18 * 2**30 and h100.bandwidth_bytes_per_s == 3.35e12
    assert h100.peak("bf16") == 989.5e12 and h100.peak("bfloat16") == 989.5e12
    assert an.get_gpu("a100").peak("tf32") == 156e12
    assert an.get_gpu("b200").peak_flops["fp32"] is None
    assert an.get_gpu("v100").peak("fp16") == 125e12
    with pytest.raises(ValueError, match="fp32, fp16"):
        an.get_gpu("v100").peak("bf16")
    # ridge point of the H100 in bf16: ~295 FLOPs/byte
    assert round(h100.peak("bf16") / h100.bandwidth_bytes_per_s) == 295


def test_unknown_gpu_lists_known():
    with pytest.raises(ValueError, match="H100 SXM") as e:
        an.get_gpu("tpu-v5")
    assert "V100 SXM" in str(e.value)


@pytest.fixture
def clean_registry(monkeypatch):
    an.known_gpus()                                   # load the built-ins first
    monkeypatch.setattr(hardware, "_REGISTRY", dict(hardware._REGISTRY))
    monkeypatch.setattr(hardware, "_ENV_LOADED", None)


def test_register_gpu_and_env_file(tmp_path, monkeypatch, clean_registry):
    an.register_gpu("Test GPU 1", "24GB", "1TB/s", {"bf16": "100T"}, aliases=["tg1"])
    assert an.get_gpu("TG1").peak("bf16") == 100e12
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"L40S": {"memory": "48GB", "bandwidth": "864GB/s",
                                         "peak_flops": {"bf16": "362T"}}}))
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(path))
    spec = an.get_gpu("l40s")
    assert spec.memory_bytes == 48e9 and spec.bandwidth_bytes_per_s == 864e9
    assert "L40S" in an.known_gpus()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(bad))
    with pytest.raises(ValueError, match="TORCHLEDGER_HARDWARE"):
        an.get_gpu("h100")


def test_analyzers_are_pure_numbers():
    # dataclasses serialise to JSON without help
    json.dumps(an.decode_step(1e9, "h200").to_dict())
    json.dumps(an.kv_cache(1, 1, 1, 1).to_dict())
    json.dumps(an.count_params(get_config("gpt2")).to_dict())
    assert math.isclose(an.get_gpu("h200").bandwidth_bytes_per_s, 4.8e12)


# ----------------------------------------------------------------------------- Korthikanti Table 2


def test_korthikanti_table2_rows_by_hand():
    """Each row of Korthikanti et al. Table 2 at s=2048, b=1, h=4096, a=32, t=8 (GPT-3-ish):
    sbh = 2048 x 4096 = 8,388,608; 5as/h = 5 x 32 x 2048 / 4096 = 80."""
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    rows = {r: activations.korthikanti_table2(s, b, h, a, tp=t, row=r) for r in activations.TABLE2_ROWS}
    assert rows["none"] == sbh * (34 + 80) == 956_301_312          # the module's doctest figure
    assert rows["tp"] == sbh * (10 + 24 // 8 + 80 // 8) == sbh * 23 == 192_937_984
    assert rows["tp+sp"] == sbh * 34 // 8 + sbh * 80 // 8 == 119_537_664
    assert rows["tp+selective"] == sbh * (10 + 3) == 109_051_904
    assert rows["tp+sp+selective"] == sbh * 34 // 8 == 35_651_584
    assert rows["full"] == 2 * sbh == 16_777_216
    # t = 1: the TP rows fall back to the no-parallelism row (selective drops the scores)
    assert activations.korthikanti_table2(s, b, h, a, tp=1, row="tp") == rows["none"]
    assert activations.korthikanti_table2(s, b, h, a, tp=1, row="tp+sp+selective") == 34 * sbh
    # fused attention keeps no s x s scores: the 5as^2b/t term goes
    assert activations.korthikanti_table2(s, b, h, a, tp=t, row="tp+sp", fused_attention=True) == sbh * 34 // 8


def test_korthikanti_table2_through_activation_memory():
    s, b, h, a, L = 2048, 1, 4096, 32, 4
    sbh = s * b * h
    assert activations.activation_memory(s, b, h, a, L).saved_bytes == L * sbh * 114
    assert activations.activation_memory(s, b, h, a, L, tp=8).saved_bytes == L * sbh * 23
    assert activations.activation_memory(s, b, h, a, L, tp=8, sequence_parallel=True).saved_bytes == L * 119_537_664
    assert activations.activation_memory(s, b, h, a, L, tp=8, recompute="selective").saved_bytes == L * sbh * 13
    assert activations.activation_memory(s, b, h, a, L, recompute="full").saved_bytes == L * 2 * sbh
    with pytest.raises(ValueError, match="tp must be"):
        activations.activation_memory(s, b, h, a, L, tp=0)
    with pytest.raises(ValueError, match="row must be"):
        activations.korthikanti_table2(s, b, h, a, row="pp")


def test_pytorch_sequence_parallel_keeps_the_gathered_inputs():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    megatron = activations.korthikanti_table2(s, b, h, a, tp=t, row="tp+sp")
    # two gathered block inputs kept whole (2sbh) instead of sharded (2sbh/8): + 2 x 1.75 sbh
    assert activations.pytorch_sp_layer_bytes(s, b, h, a, tp=t) == megatron + 2 * (2 * sbh - 2 * sbh // 8)
    assert activations.pytorch_sp_layer_bytes(s, b, h, a, tp=t) == megatron + 29_360_128
    # a plan gathering per projection (q, k, v, gate, up) keeps five
    assert activations.pytorch_sp_layer_bytes(s, b, h, a, tp=t, gathered_inputs=5) == megatron + 5 * 14_680_064


# ----------------------------------------------------------------------------- references per mesh


def test_sharded_numel_tp_then_fsdp():
    # TP 4 splits 130 rows: rank 0 gets ceil(130/4) = 33; FSDP over 2 pads dim 0: ceil(33/2) = 17
    assert memory.sharded_numel((130, 64), tp=4, tp_dim=0, shard_group=2) == 17 * 64
    # a row-parallel weight (TP splits dim 1): 64 rows / 2 = 32 x ceil(130/4) = 33
    assert memory.sharded_numel((64, 130), tp=4, tp_dim=1, shard_group=2) == 32 * 33
    assert memory.sharded_numel((), shard_group=8) == 1                  # a scalar: one element
    assert memory.sharded_numel((4096, 11008), shard_group=4096) == 11008   # one row each


def test_static_bytes_per_rank_by_layout():
    # HSDP 2x4 of a 1,000-param model: 16 x 1000 / 4 (the 2 replicas divide nothing)
    assert memory.static_per_rank_closed_form(1000, shard_group=4, replicate_group=2) == 4000
    # DDP over 8: every rank holds 16 x 1000
    assert memory.static_per_rank_closed_form(1000, replicate_group=8) == 16000
    # TP 4 x FSDP 2, 800 split + 200 whole params: 16 x (800 / 8 + 200 / 2) = 3,200
    assert memory.static_per_rank_closed_form(800, 200, tp=4, shard_group=2) == 3200
    # mixed precision AdamW is still 16 B per param (bf16 param + grad 4, fp32 master 4, m + v 8)
    assert memory.static_per_rank_closed_form(800, 200, tp=4, shard_group=2, precision="mixed") == 3200
    rows = [((130, 64), 1, -1, 8, 1, True, 1), ((64,), 1, -1, 8, 1, False, 2)]
    # 17 x 64 trainable x 16 B + 2 frozen 8-element shards x 4 B = 17,408 + 64
    assert memory.static_bytes_per_rank(rows) == {"bytes": 17408 + 64, "numel": 1088 + 16,
                                                  "numel_unpadded": 130 * 64 / 8 + 16}
    with pytest.raises(ValueError, match="shard_group"):
        memory.static_per_rank_closed_form(10, shard_group=0)


def test_fsdp_and_tp_comm_closed_forms():
    from torchledger.formulas.comm import fsdp_comm_per_step, tp_comm_per_layer
    # FSDP over 4, P = G = 800 B: forward 200, backward 200 + 800; bus (n-1)/n: 3 x 600
    c = fsdp_comm_per_step(800, 800, shard_group=4)
    assert c.sent == {"forward": 200, "backward": 1000, "optimizer": 0, "total": 1200} and c.bus_bytes == 1800
    # the root kept gathered (regather 0) and HSDP x 2: + an all-reduce of 200 over 2 replicas
    c = fsdp_comm_per_step(800, 800, shard_group=4, replicate_group=2, regather_bytes=0)
    assert c.sent["backward"] == 800 + 200 and c.bus_bytes == 600 + 600 + 200 * 2 * 1 // 2
    # bf16 gathers (P = 400), fp32 reduce (G = 800)
    assert fsdp_comm_per_step(400, 800, shard_group=4).total == 100 + 100 + 800
    # TP 8 per layer, 4,096 tokens x 4,096 hidden in bf16: X = 33,554,432 B
    x = 4096 * 4096 * 2
    assert tp_comm_per_layer(4096, 4096, tp=8).sent == {"forward": 2 * x, "backward": 2 * x,
                                                        "optimizer": 0, "total": 4 * x}
    # PyTorch's unfused q, k, v, gate, up: 5 backward all-reduces, 3 more than Megatron's
    assert tp_comm_per_layer(4096, 4096, tp=8, column_inputs=5).sent["backward"] == 5 * x
    # sequence parallel: all-gathers send X/8, reduce-scatters X; bus (n-1)/n x X each
    sp = tp_comm_per_layer(4096, 4096, tp=8, sequence_parallel=True)
    assert sp.sent["forward"] == 2 * x // 8 + 2 * x and sp.bus_bytes == 8 * x * 7 // 8


def test_mesh_groups_feed_the_per_rank_forms():
    # Llama-3.1-405B's layout: FSDP over dp x cp = 8, TP 8, PP 9 stages
    g = memory.mesh_groups(dp=4, cp=2, tp=8, pp=9)
    assert g == {"shard_group": 8, "replicate_group": 1, "tp": 8, "pp": 9, "ep": 1}
    # a stage of 9 holding 1,000 split + 100 whole params: 16 x (1000/64 + 100/8) = 450
    assert memory.static_per_rank_closed_form(1000, 100, shard_group=g["shard_group"], tp=g["tp"]) == 450
    assert memory.mesh_groups(dp=2, dp_replicate=4)["replicate_group"] == 4
    with pytest.raises(ValueError, match="mesh dimension tp"):
        memory.mesh_groups(tp=0)
