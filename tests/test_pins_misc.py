"""Pins for shape capture, Korthikanti's table and calibrate (issue 33, items 7, 8 and 10): each
expected value is worked out by hand in a comment, so that a one-line change of the behaviour
it names fails the test."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchledger
from torchledger.formulas import hardware
from torchledger.formulas.activations import activation_memory, korthikanti_table2
from torchledger.formulas.hardware import get_gpu
from torchledger.record import StepRecord
from torchledger.tracer import opshapes

# -- item 7: shape capture ---------------------------------------------------------------------


class _BmmAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 32))

    def forward(self, a, c, q, k, v):
        y = torch.bmm(a, self.w).sum() + torch.baddbmm(c, a, self.w).sum()
        return y + F.scaled_dot_product_attention(q, k, v).sum()


def _shapes(rec, phase, op):
    (row,) = [o for o in rec.ops if o["phase"] == phase and o["op"] == op]
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()} for s in row["shapes"]]


def test_bmm_and_baddbmm_keep_their_batch_and_sdpa_its_causality():
    # a (4, 8, 16) @ w (4, 16, 32): batch 4, m 8, n 32, k 16; FLOPs 2 x 4 x 8 x 32 x 16 = 32,768.
    # baddbmm(c, a, w) is the same product. Backward: grad_w = a^T @ grad, (4, 16, 8) @ (4, 8, 32):
    # [4, 16, 32, 8], once per product: 2 x 32,768 = 65,536.
    # SDPA, not causal: q (2, 4, 16, 8) over k, v (2, 4, 24, 8): [b 2, h 4, sq 16, sk 24, d 8,
    # dv 8]; FLOPs 2 x 2 x 4 x 16 x 24 x (8 + 8) = 98,304.
    m = _BmmAttn()
    a, c = torch.randn(4, 8, 16), torch.randn(4, 8, 32)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8)
    with torchledger.trace(m, tokens=8) as t:
        m(a, c, q, k, v).backward()
    rec = t.record
    mm = {"mnk": [4, 8, 32, 16], "dtype": "fp32", "count": 1, "flops": 32768}
    assert _shapes(rec, "forward", "aten.bmm.default") == [mm]
    assert _shapes(rec, "forward", "aten.baddbmm.default") == [mm]
    assert _shapes(rec, "backward", "aten.bmm.default") == [{"mnk": [4, 16, 32, 8], "dtype": "fp32", "count": 2,
                                                             "flops": 65536}]
    (sdpa,) = [o["op"] for o in rec.ops if o["phase"] == "forward" and o["kind"] == "attention"]
    assert _shapes(rec, "forward", sdpa) == [{"attn": [2, 4, 16, 24, 8, 8], "dtype": "fp32", "count": 1,
                                              "flops": 98304, "causal": False}]


def test_a_causal_sdpa_is_recorded_causal():
    # the same SDPA with is_causal=True: the signature says causal (the step-time model then
    # prices half the score blocks)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8)

    class Causal(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
    m = Causal()
    with torchledger.trace(m, tokens=8) as t:
        m(q, k, v).backward()
    (sdpa,) = [o["op"] for o in t.record.ops if o["phase"] == "forward" and o["kind"] == "attention"]
    (entry,) = _shapes(t.record, "forward", sdpa)
    assert entry["attn"] == [2, 4, 16, 24, 8, 8] and entry["causal"] is True


@pytest.mark.parametrize("name, off", [("_flash_attention_forward", 0), ("_flash_attention_backward", 1),
                                       ("_efficient_attention_forward", 0), ("_efficient_attention_backward", 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_flash_and_efficient_layout_reads_b_s_h_d(name, off, causal):
    # the CUDA flash / memory-efficient kernels take (b, s, h, d): q (2, 16, 4, 8), k (2, 24, 4, 8),
    # v (2, 24, 4, 12) -> b 2, hq 4, sq 16, sk 24 (k's dim 1, not its heads), d 8, dv 12.
    # CPU traces never emit these ops: the arguments are built by hand (meta tensors).
    func = getattr(torch.ops.aten, name).default
    q = torch.empty(2, 16, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 24, 4, 8, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 24, 4, 12, device="meta", dtype=torch.bfloat16)
    g = torch.empty(2, 16, 4, 12, device="meta", dtype=torch.bfloat16)
    args = ((g,) if off else ()) + (q, k, v)
    log = opshapes.ShapeLog()
    # causal is read from the op's FLOPs: a causal call's causal count is under its dense one
    fc = SimpleNamespace(kind="attention", flops=1000, flops_causal=500 if causal else 1000)
    opshapes.note_op(log, 7, func, args, "forward", None, fc)
    assert log.sigs == {("forward", None, 7, ("attn", (2, 4, 16, 24, 8, 12), "bf16", causal)): [1, 1000]}


# -- item 8: Korthikanti's table -----------------------------------------------------------------

def test_selective_recompute_at_tp_1_drops_the_score_term():
    # s 2048, b 1, h 4096, a 32: sbh = 8,388,608. No recompute: 34 sbh + 5 a s^2 b =
    # 285,212,672 + 671,088,640 = 956,301,312 per layer. Selective recompute recomputes the
    # score ops: 34 sbh = 285,212,672 (Table 2's tp+selective row at t = 1: 10 sbh + 24 sbh),
    # 3 layers 855,638,016
    sbh = 2048 * 4096
    assert activation_memory(2048, 1, 4096, 32, 3).per_layer_bytes == 34 * sbh + 5 * 32 * 2048 ** 2 == 956_301_312
    sel = activation_memory(2048, 1, 4096, 32, 3, recompute="selective")
    assert sel.per_layer_bytes == 34 * sbh == 285_212_672
    assert sel.saved_bytes == sel.peak_bytes == 3 * 285_212_672
    for row in ("tp+selective", "tp+sp+selective"):
        assert korthikanti_table2(2048, 1, 4096, 32, tp=1, row=row) == 285_212_672
    # sequence parallel at t = 1 is the same row: 34 sbh / 1
    assert activation_memory(2048, 1, 4096, 32, 1, recompute="selective",
                             sequence_parallel=True).per_layer_bytes == 285_212_672


# -- item 10: calibrate ------------------------------------------------------------------------------

# One step of four 8192^3 bf16 matmuls on an H100: 2,048 tiles of 256x128, 16 waves of 132
# (2048/2112 full), K 128 + 2 iterations; at a matmul fraction f each takes
# 2 x 8192^3 / (989.5e12 x f x (2048/2112) x (128/130)); memory (3 x 8192^2 x 2 B = 403 MB at
# 0.8 x 3.35 TB/s = 150 us) and the launch floor are below it.
def _mm_seconds(f):
    return 4 * 2 * 8192 ** 3 / (989.5e12 * f * (2048 / 2112) * (128 / 130))


def _record(rows, **totals):
    rec = StepRecord()
    rec.meta.update(device="cuda:0", dtype="bfloat16")
    rec.totals.update(tokens=1024, hardware_flops=0, params=1, peak_bytes=1, activation_bytes=0, **totals)
    rec.totals["flops"] = {"forward": 0, "backward": 0, "optimizer": 0, "total": 0, "other": 0}
    rec.ops = rows
    return rec


_MM = [{"op": "aten.mm.default", "phase": "forward", "module": "a", "kind": "matmul", "count": 4,
        "flops": 4 * 2 * 8192 ** 3, "shapes": [{"mnk": [1, 8192, 8192, 8192], "dtype": "bf16", "count": 4,
                                               "flops": 4 * 2 * 8192 ** 3}]}]
_ATT = [{"op": "aten._scaled_dot_product_flash_attention.default", "phase": "forward", "module": "a",
         "kind": "attention", "count": 8, "flops": 0,
         "shapes": [{"attn": [4, 32, 8192, 8192, 128, 128], "dtype": "bf16", "causal": True, "count": 8,
                     "flops": 0}]}]


def test_calibrate_fits_the_untraced_step_time():
    # untraced 7.7587 ms = the step at f = 0.6; traced (with the tracer's overhead) twice that,
    # which would fit f = 0.3
    from torchledger.steptime.calibrate import fit_efficiency, measured_seconds
    from torchledger.steptime.predict import predict_step_time
    h100 = get_gpu("h100")
    rec = _record(_MM, step_seconds=2 * _mm_seconds(0.6), step_seconds_untraced=_mm_seconds(0.6))
    assert _mm_seconds(0.6) == pytest.approx(7.7587e-3, rel=1e-4)
    # (the row calibrate writes: the fraction of whole measured steps, no sustained derate)
    row = {"matmul_peak_fraction": 0.6, "sustained_fraction": 1.0}
    assert predict_step_time(rec, replace(h100, efficiency=row))["seconds"] == pytest.approx(_mm_seconds(0.6), rel=1e-9)
    assert measured_seconds(rec) == _mm_seconds(0.6)
    fit = fit_efficiency([rec], h100)
    assert fit["efficiency"]["matmul_peak_fraction"] == pytest.approx(0.6, rel=1e-4)
    assert fit["efficiency"]["sustained_fraction"] == 1.0
    # a record with no untraced figure: its traced one
    rec.totals["step_seconds_untraced"] = None
    assert fit_efficiency([rec], h100)["efficiency"]["matmul_peak_fraction"] == pytest.approx(0.3, rel=1e-4)


def test_calibrate_output_onto_an_existing_file_keeps_the_rows_other_fields(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from torchledger.cli import cli
    monkeypatch.delenv(hardware.HARDWARE_ENV, raising=False)
    path = _record(_MM, step_seconds=_mm_seconds(0.6)).save(str(tmp_path / "r.json"))
    out = tmp_path / "hw.json"
    other = {"memory": "16GB", "bandwidth": "1TB/s", "peak_flops": {"bf16": "100T"}}
    out.write_text(json.dumps({
        "H100 SXM": {"nic": "25GB/s", "nvlink": "400GB/s", "nics_per_node": 4,
                     "efficiency": {"matmul_peak_fraction": 0.5},
                     "sources": {"nic": "our cluster: 4 x 200 Gb/s per node"}},
        "Z1": other}))
    res = CliRunner().invoke(cli, ["calibrate", path, "--gpu", "h100", "--output", str(out)])
    assert res.exit_code == 0, res.output
    table = json.loads(out.read_text())
    assert table["Z1"] == other                                  # the other part as it was
    row = table["H100 SXM"]
    assert (row["nic"], row["nvlink"], row["nics_per_node"]) == ("25GB/s", "400GB/s", 4)
    assert row["sources"]["nic"] == "our cluster: 4 x 200 Gb/s per node"
    assert row["sources"]["efficiency"].startswith("torchledger calibrate from 1 record(s)")
    assert row["efficiency"]["matmul_peak_fraction"] == pytest.approx(0.6, rel=1e-4)   # refitted


def test_calibrate_into_the_hardware_file_in_use_keeps_its_unfitted_efficiency(tmp_path, monkeypatch,
                                                                                 restore_registry):
    # The documented loop: TORCHLEDGER_HARDWARE names the file calibrate writes. Its H100 row
    # says Hopper tiles need 100 FLOP/B (not 85) and SDPA runs cuDNN. Under 100 FLOP/B every
    # tile is feed-bound, the best 256x128 at 2*256*128/(384*2) = 85.33/100 = 0.85333, so a
    # step measured at f = 0.6 of the unbounded model fits f = 0.6/0.85333 = 0.70312. The
    # written row keeps the two unfitted keys, and the part it describes predicts the
    # measured step again (dropping them would predict 0.85333 x the measurement).
    from click.testing import CliRunner
    from torchledger.steptime.predict import predict_step_time
    from torchledger.cli import cli
    out = tmp_path / "hw.json"
    out.write_text(json.dumps({"H100 SXM": {"efficiency": {"matmul_min_intensity": 100.0,
                                                           "attention_kernel": "cudnn"}}}))
    monkeypatch.setenv(hardware.HARDWARE_ENV, str(out))
    measured = _mm_seconds(0.6)
    rec = _record(_MM, step_seconds=measured)
    res = CliRunner().invoke(cli, ["calibrate", rec.save(str(tmp_path / "r.json")), "--gpu", "h100",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    eff = json.loads(out.read_text())["H100 SXM"]["efficiency"]
    assert (eff["matmul_min_intensity"], eff["attention_kernel"]) == (100.0, "cudnn")
    assert eff["matmul_peak_fraction"] == pytest.approx(0.6 / (2 * 256 * 128 / (384 * 2) / 100), rel=1e-4)
    hardware._ENV_LOADED = None                     # read the file calibrate wrote
    assert predict_step_time(rec, get_gpu("h100"))["seconds"] == pytest.approx(measured, rel=1e-4)


def test_fitted_attention_fractions_are_capped_at_one():
    from torchledger.steptime.calibrate import _apply, fit_efficiency
    from torchledger.steptime.predict import predict_step_time
    from torchledger.formulas import steptime as st
    h100 = get_gpu("h100")
    # H100's fractions x 3: flash [0.38, 0.30] -> [1.14 -> 1.0, 0.9]; cuDNN [0.60, 0.45] ->
    # [1.8 -> 1.0, 1.35 -> 1.0]; memory-efficient [0.20, 0.16] -> [0.6, 0.48]
    got = _apply(st.efficiency(h100), {"attention_scale": 3.0})["attention"]
    assert got["flash"] == [1.0, pytest.approx(0.9)]
    assert got["cudnn"] == [1.0, 1.0]
    assert got["efficient"] == [pytest.approx(0.6), pytest.approx(0.48)]
    # a step measured at a tenth of its prediction pushes the scale past 1/0.38 = 2.63, where
    # flash's forward saturates: the written row never exceeds the peak
    rec = _record(_ATT)
    rec.totals["step_seconds"] = predict_step_time(rec, h100)["seconds"] / 10
    fit = fit_efficiency([rec], h100)
    att = fit["efficiency"]["attention"]
    assert fit["attention_scale"] > 1 / 0.38
    assert att["flash"][0] == 1.0 and att["cudnn"] == [1.0, 1.0]
    assert max(f for fr in att.values() for f in fr) == 1.0
