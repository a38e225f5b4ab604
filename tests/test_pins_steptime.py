"""Pins for the step-time model (issue 33, items 1, 2, 3 and 6): each expected value is worked
out by hand in a comment, so that a one-line change of the behaviour it names fails the test.

Shared figures:
  H100 SXM: 132 SMs, bf16 989.5 TF/s, tf32 494.7, HBM 3.35 TB/s, NVLink 450 GB/s per direction,
            8 NICs of 50 GB/s per 8-GPU node; single-kernel matmul fraction 0.8435, Hopper tiles need
            85 FLOP/B of operand, flash attention [0.38 fwd, 0.30 bwd] of peak.
  A100 SXM: 108 SMs, bf16 312 TF/s; sustained matmul fraction 0.88, tiles need 64 FLOP/B.
  Single kernels: the pins below take sustained_fraction = 1 (the training derate is pinned in
            test_steptime_kernels.py); 0.8435 makes 8192^3 797 TF/s on the H100.
  Defaults: K tile 64, 2 K iterations of prologue/epilogue per tile, attention_seq_half 256,
            causal attention at 0.87 of the dense kernel's rate (attention_causal_fraction),
            memory_fraction 0.8, nvlink_fraction 0.8, network_fraction 0.9, launch floor 5 us.
"""
import json

import pytest

from torchledger.formulas import hardware
from torchledger.formulas import steptime as st
from torchledger.formulas.hardware import get_gpu


def _single(gpu, **kw) -> dict:
    """The part's efficiency row for one kernel: no sustained-training derate."""
    return dict(st.efficiency(gpu), sustained_fraction=1.0, **kw)


def _fraction(m, n, k, dtype, gpu, eff=None, column=None):
    """The fraction of ``column``'s dense peak ``matmul_fraction`` gives, and its tile."""
    t, tile = st.matmul_fraction(m, n, k, 1, dtype, gpu, eff or _single(gpu))
    return 2.0 * m * n * k / t / gpu.peak(column or dtype), tile


# -- item 1: the matmul tile model ------------------------------------------------------------

def test_feed_bound_is_per_byte_of_operand_h100_bf16_128x128():
    # 16384 x 4096 x 4096 bf16 with 128x128 tiles only: a tile loads (128 + 128) x 64 elements
    # of 2 bytes per K step for 2 x 128 x 128 x 64 FLOPs: 2*128*128 / (256 * 2) = 64 FLOP/B of
    # the 85 Hopper needs -> feed 64/85 = 0.75294.
    # tiles 128 x 32 = 4,096 on 132 SMs: 32 waves (4096 / 4224 = 0.96970 full);
    # K loop 4096/64 = 64 iterations + 2: 64/66 = 0.96970;
    # 0.8435 x 0.75294 x 0.96970 x 0.96970 = 0.59720 of the bf16 peak.
    h100 = get_gpu("h100")
    eff = _single(h100, matmul_tiles=[[128, 128]])
    frac, tile = _fraction(16384, 4096, 4096, "bf16", h100, eff)
    assert tile == (128, 128, 1)
    assert frac == pytest.approx(0.8435 * (64 / 85) * (4096 / 4224) * (64 / 66), rel=1e-9)
    assert frac == pytest.approx(0.5972, abs=1e-4)
    # the same tiling on tf32 (fp32 with TF32 allowed): 4-byte operands, 2*128*128/(256*4) =
    # 32 FLOP/B, against a need scaled to the tf32 column: 85 x 494.7/989.5 = 42.495 FLOP/B
    # -> feed 32/42.495 = 0.75303: the same 0.597 of the *tf32* peak. Counting elements rather
    # than bytes would give 64/42.5 -> feed 1 -> 0.793.
    eff32 = dict(eff, allow_tf32=True)
    frac32, _ = _fraction(16384, 4096, 4096, "fp32", h100, eff32, column="tf32")
    assert frac32 == pytest.approx(0.8435 * (32 / (85 * 494.7 / 989.5)) * (4096 / 4224) * (64 / 66), rel=1e-9)


def test_the_default_tiles_h100_bf16_16384x4096x4096_hand_check():
    # the module docstring's hand check: 256x128 tiles (2*256*128/(384*2) = 85.3 FLOP/B >= 85:
    # not feed-bound), 64 x 32 = 2,048 tiles = 16 waves of 132 (2048/2112 = 0.96970),
    # K 64/66 = 0.96970: 0.8435 x 0.96970^2 = 0.79316 of peak
    h100 = get_gpu("h100")
    frac, tile = _fraction(16384, 4096, 4096, "bf16", h100)
    assert tile == (256, 128, 1)
    assert frac == pytest.approx(0.8435 * (2048 / 2112) * (64 / 66), rel=1e-9)


def test_skinny_tile_is_the_smallest_power_of_two_at_least_m():
    # 64 x 8192 x 8192 bf16 on H100: a tile's M side shrinks to 64 (the smallest power of two
    # >= 64). Best candidate: 64x256 (from 128x256), 1 x 32 = 32 tiles, fewer than 132 SMs:
    # split-K by 4 -> 128 units in one wave, K 128/4 = 32 + 2 = 34 iterations.
    #   feed: 2*64*256/(320*2) = 51.2 FLOP/B / 85 = 0.60235
    #   per SM: 989.5e12 x 0.8435 / 132 = 6.3231e12 FLOP/s
    #   one iteration: 2*64*256*64 = 2,097,152 FLOPs / (6.3231e12 x 0.60235) = 0.55061 us
    #   34 x 0.55061 us = 18.721 us
    # (a side rounded past m, 128 for m = 64, makes 128x256 and 64x128 the candidates: 21.8 us)
    h100 = get_gpu("h100")
    t, tile = st.matmul_fraction(64, 8192, 8192, 1, "bf16", h100, _single(h100))
    assert tile == (64, 256, 4)
    per_sm = 989.5e12 * 0.8435 / 132
    feed = (2 * 64 * 256 / (320 * 2)) / 85
    assert t == pytest.approx(34 * 2 * 64 * 256 * 64 / (per_sm * feed), rel=1e-9)
    assert t == pytest.approx(18.721e-6, rel=1e-4)


def test_sustained_fraction_applies_to_a_tile_that_is_not_feed_bound_a100():
    # A100 8192^3 bf16: 256x128 tiles feed 85.3 FLOP/B >= 64: not feed-bound; 32 x 64 = 2,048
    # tiles on 108 SMs: 19 waves (2048 / 2052 = 0.99805); K 128/130 = 0.98462;
    # 0.88 (A100's sustained fraction) x 0.99805 x 0.98462 = 0.86478 of 312 TF/s
    a100 = get_gpu("a100")
    frac, tile = _fraction(8192, 8192, 8192, "bf16", a100)
    assert tile == (256, 128, 1)
    assert frac == pytest.approx(0.88 * (2048 / 2052) * (128 / 130), rel=1e-9)
    assert frac == pytest.approx(0.865, abs=5e-4)
    # H100 8192^3: 2,048 tiles on 132 SMs: 16 waves (0.96970), K 0.98462, x 0.8435 = 0.80535:
    # 796.9 TF/s, the published cuBLAS figure the fraction was set from
    h100 = get_gpu("h100")
    frac, tile = _fraction(8192, 8192, 8192, "bf16", h100)
    assert tile == (256, 128, 1)
    assert frac == pytest.approx(0.8435 * (2048 / 2112) * (128 / 130), rel=1e-9)
    assert frac * 989.5 == pytest.approx(796.9, abs=0.1)


# -- item 2: attention ----------------------------------------------------------------------------

def test_attention_backward_is_2_5x_forward_flops_h100():
    # b 1, 32 heads, S 8192, d = dv = 128, causal, bf16, flash:
    #   forward FLOPs 2 x 32 x 8192^2 x 256 / 2 = 2^39 = 549,755,813,888
    #   rate 0.38 x 8192/(8192 + 256) x 0.87 (a causal kernel) = 0.32058 of 989.5 TF/s
    #   -> 1.73307 ms (1.50777 ms at the dense kernel's rate)
    #   backward FLOPs 2.5 x 2^39 (the recomputed Q K^T), rate 0.30 x 0.96970 x 0.87 = 0.25309
    #   -> 5.48804 ms
    h100 = get_gpu("h100")
    fwd = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", h100, eff=_single(h100))
    bwd = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, True, "bf16", h100, eff=_single(h100))
    seq = 8192 / (8192 + 256)
    assert fwd == pytest.approx(2 ** 39 / (989.5e12 * 0.38 * seq * 0.87), rel=1e-9)
    assert bwd == pytest.approx(2.5 * 2 ** 39 / (989.5e12 * 0.30 * seq * 0.87), rel=1e-9)
    assert (fwd, bwd) == (pytest.approx(1.73307e-3, rel=1e-5), pytest.approx(5.48804e-3, rel=1e-5))


def test_attention_short_sequence_factor():
    # S 512 (other sizes as above): FLOPs 2 x 32 x 512^2 x 256 / 2 = 2^31; rate 0.38 x
    # 512/(512 + 256) x 0.87 (causal) = 0.22040 -> 2^31 / (989.5e12 x 0.22040) = 9.8470 us;
    # above the memory roofline (2 x (32*512*256 + 2*32*512*128) = 16.8 MB / 2.68 TB/s =
    # 6.26 us) and the 5 us launch floor. Without the factor it would be 6.57 us.
    h100 = get_gpu("h100")
    short = st.attention_seconds(1, 32, 512, 512, 128, 128, True, False, "bf16", h100, eff=_single(h100))
    assert short == pytest.approx(2 ** 31 / (989.5e12 * 0.38 * 512 / 768 * 0.87), rel=1e-9)
    assert short == pytest.approx(9.8470e-6, rel=1e-4)
    # per FLOP, S = 512 runs at (512/768) / (8192/8448) = 0.6875 of S = 8192's rate
    long = st.attention_seconds(1, 32, 8192, 8192, 128, 128, True, False, "bf16", h100, eff=_single(h100))
    assert (long / 2 ** 39) / (short / 2 ** 31) == pytest.approx((512 / 768) / (8192 / 8448), rel=1e-9)


# -- item 3: collectives ----------------------------------------------------------------------------

def test_tree_all_reduce_moves_the_buffer_twice_512_h100s():
    # 1 GB all-reduce over 512 H100s (64 nodes of 8, contiguous): bus bandwidth min(NVLink
    # 450 x 0.8 = 360, node NICs 8 x 50 x 0.9 = 360) = 360 GB/s.
    #   tree/Simple: bandwidth 0.9 x 360 = 324 GB/s; reduce then broadcast: 2 x 1e9 / 324e9
    #   = 6.1728 ms; latency 0 + 2 x (7 x 28 + log2(64) x 50) = 992 us -> 7.1648 ms
    #   (ring/Simple: (8.4 + 896 x 3.4 + 126 x 9.6) x 1.9 = 8.10 ms latency alone: slower)
    h100 = get_gpu("h100")
    t, algo = st.collective_seconds("all_reduce", 1e9, 512, 512, h100)
    assert algo == "tree/Simple"
    assert t == pytest.approx(992e-6 + 2 * 1e9 / (0.9 * 360e9), rel=1e-9)
    assert t == pytest.approx(7.1648e-3, rel=1e-4)


def test_ring_all_reduce_over_8_h100s_the_modules_hand_check():
    # one node, ring/Simple (NVLS off): latency 8.4 + 2 x 7 x 3.4 = 56 us; bus bytes 2 x 7/8 x
    # 1 GB = 1.75 GB at 0.8 x 450 GB/s (NVLink 4, one direction) = 4.8611 ms; 4.9171 ms
    h100 = get_gpu("h100")
    assert h100.nvlink_bytes_per_s == 450e9
    t, algo = st.collective_seconds("all_reduce", 1e9, 8, 8, h100, dict(st.efficiency(h100), nvls_fraction=0))
    assert algo == "ring/Simple"
    assert t == pytest.approx(56e-6 + 1.75e9 / 360e9, rel=1e-9)
    assert t == pytest.approx(4.917e-3, rel=1e-4)


def test_nvls_all_reduce_in_one_h100_node():
    # NVLink SHARP: 25 us + 1.75 GB of bus bytes at 480 GB/s (480/450 of NVLink 4's 450) =
    # 3.6458 ms + 0.025 = 3.6708 ms, faster than the ring's 4.917: NCCL's choice, and the model's
    h100 = get_gpu("h100")
    t, algo = st.collective_seconds("all_reduce", 1e9, 8, 8, h100)
    assert algo == "nvls/Simple"
    assert t == pytest.approx(25e-6 + 1.75e9 / 480e9, rel=1e-9)
    # across nodes (16 ranks, 2 nodes) no NVLS: ring or tree; A100's NVSwitch has no SHARP
    assert not st.collective_seconds("all_reduce", 1e9, 16, 16, h100)[1].startswith("nvls")
    assert st.collective_seconds("all_reduce", 1e9, 8, 8, get_gpu("a100"))[1] == "ring/Simple"
    # a small one stays on the ring's LL protocol (NVLS's 25 us latency)
    assert st.collective_seconds("all_reduce", 4096, 8, 8, h100)[1] == "ring/LL"


def test_the_communication_stream_is_a_queue():
    # three units (gather 2, compute 5, reduce-scatter 4):
    #   unit 0: gather 0-2, compute 2-7, its reduce-scatter issued at 7
    #   unit 1: gather issued at 2 (prefetch), 2-4; compute 7-12; reduce-scatter issued at 12
    #   unit 2: gather issued at 7, behind the reduce-scatter issued at 7: that runs 7-11,
    #           the gather 11-13; compute 13-18; reduce-scatter issued at 18
    #   then: reduce-scatter of unit 1 13-17, of unit 2 18-22 -> 22 s; compute 15, exposed 7
    # (a gather that overtook the reduce-scatter would run 7-9: compute 12-17, 21 s)
    r = st.overlap_timeline([(2, 5, 4)] * 3)
    assert r == {"seconds": 22, "compute": 15, "comm": 18, "exposed": 7}


# -- item 6: the hardware table --------------------------------------------------------------------

def test_a_partial_efficiency_row_merges_with_the_builtin_row(tmp_path, monkeypatch, restore_registry):
    # MI300X's built-in row has launch_s 8 us (hipBLASLt/ROCm launch cost); a user file that
    # only refits the matmul fraction keeps it: a 128^3 matmul (2 x 128^3 = 4.2 MFLOP, far
    # under a microsecond of compute) is priced at the 8 us floor, not the 5 us default
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"MI300X": {"efficiency": {"matmul_peak_fraction": 0.55}}}))
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(path))
    g = get_gpu("mi300x")
    assert dict(g.efficiency) == {"launch_s": 8e-6, "matmul_peak_fraction": 0.55}
    eff = st.efficiency(g)
    assert (eff["launch_s"], eff["matmul_peak_fraction"]) == (8e-6, 0.55)
    assert st.matmul_seconds(128, 128, 128, 1, "bf16", g) == 8e-6
    # and register_gpu() the same way
    g = hardware.register_gpu("MI300X", efficiency={"memory_fraction": 0.7})
    assert dict(g.efficiency) == {"launch_s": 8e-6, "matmul_peak_fraction": 0.55, "memory_fraction": 0.7}
