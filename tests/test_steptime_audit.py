"""audit --gpu end to end on the tiny GPT-2 example: predictions.step_time in the JSON with
INTERFACE.md's names, every format shows it, TL-MFU-001 on the predicted MFU of a fake step,
--baseline gates the predicted step time, --compiled fuses; and the tracer's per-op capture
(shapes, fusion chains) on a real traced step."""
import json
import os

import pytest
import torch
from click.testing import CliRunner

import torchledger
from torchledger.cli import cli
from torchledger.record import StepRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "gpt2_tiny.py")
KEYS = {"gpu", "seconds", "micro_batches", "tokens_per_s_per_gpu", "mfu", "hfu", "by_phase", "by_kind",
        "comm_seconds", "comm_exposed_seconds", "bubble_seconds", "bound", "assumptions"}


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    out = tmp_path_factory.mktemp("st") / "tiny.json"
    res = CliRunner().invoke(cli, ["audit", TINY, "--steps", "1", "--gpu", "h100", "--format", "json",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    return out, json.loads(out.read_text())


def test_json_carries_the_prediction(audited):
    _, d = audited
    p = d["predictions"]["step_time"]
    assert KEYS <= set(p)
    assert set(p["by_kind"]) >= {"matmul", "attention", "memory_bound", "launch", "comm_exposed", "bubble"}
    assert set(p["by_phase"]) >= {"forward", "backward", "recompute", "optimizer"}
    assert p["gpu"] == "H100 SXM" and p["seconds"] > 0
    # the kinds add up to the step; tokens/s is the step's tokens over it (4 x 64 = 256)
    assert sum(p["by_kind"].values()) == pytest.approx(p["seconds"])
    assert p["tokens_per_s_per_gpu"] == pytest.approx(256 / p["seconds"])
    mods = {m["name"]: m["predicted_seconds"] for m in d["modules"]}
    assert 0 < mods["blocks.0"] <= mods[""] <= p["seconds"]
    # a tiny model on an H100: launch-bound, far below min_mfu: TL-MFU-001 on the prediction
    (f,) = [f for f in d["findings"] if f["rule"] == "TL-MFU-001"]
    assert "predicted MFU" in f["message"] and f["measured"] == pytest.approx(p["mfu"])


@pytest.mark.parametrize("fmt, needle", [("table", "pred time"), ("markdown", "predicted step time"),
                                         ("html", "predicted step time"), ("csv", "predicted_seconds")])
def test_every_format_shows_it(audited, fmt, needle):
    path, _ = audited
    res = CliRunner().invoke(cli, ["report", str(path), "--format", fmt])
    assert res.exit_code == 0, res.output
    assert needle in res.output
    if fmt == "table":
        assert "predicted step time on H100 SXM" in res.output and "where the time goes" in res.output


def test_baseline_fails_when_the_predicted_step_grows(audited, tmp_path):
    path, d = audited
    base = json.loads(json.dumps(d))
    base["predictions"]["step_time"]["seconds"] = d["predictions"]["step_time"]["seconds"] / 2
    bpath = tmp_path / "base.json"
    bpath.write_text(json.dumps(base))
    res = CliRunner().invoke(cli, ["audit", TINY, "--steps", "1", "--gpu", "h100", "--baseline", str(bpath)])
    assert res.exit_code == 1
    assert "predicted step time on H100 SXM grew +100.00%" in res.output


def test_compiled_is_faster_and_said(audited, tmp_path):
    from torchledger.steptime.predict import predict_step_time
    _, d = audited
    rec = StepRecord.from_dict(d)
    eager = predict_step_time(rec, "h100")
    fused = predict_step_time(rec, "h100", {"compiled": True})
    assert fused["seconds"] < eager["seconds"]
    assert fused["by_kind"]["memory_bound"] < eager["by_kind"]["memory_bound"]
    assert any("fused" in a for a in fused["assumptions"])


def test_empty_record_predicts_nothing():
    from torchledger.steptime.predict import predict_step_time
    p = predict_step_time(StepRecord(), "h100")
    assert p["seconds"] == 0 and p["mfu"] is None and p["bound"].startswith("nothing to time")


def test_capture_records_shapes_and_chains():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    q = torch.randn(2, 3, 32, 8, requires_grad=True)
    with torchledger.trace(lin, tokens=4) as t:
        y = torch.relu(lin(x)).mul(2).sum()
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
        (y + a).backward()
    rows = t.record.ops
    (fwd,) = [r for r in rows if r["kind"] == "matmul" and r["phase"] == "forward"]
    # addmm(bias, x [4,16], W^T [16,8]): m=4, n=8, k=16; 2*4*8*16 = 1024 FLOPs
    # a shape is a tuple in memory (untracked by the gc: opshapes.attach_shapes), a list in JSON
    assert fwd["shapes"] == [{"mnk": (1, 4, 8, 16), "dtype": "fp32", "count": 1, "flops": 1024}]
    for r in rows:
        if r["kind"] in ("matmul", "attention") and r.get("shapes"):
            assert sum(s["count"] for s in r["shapes"]) == r["count"]
    (att,) = [r for r in rows if r["kind"] == "attention" and r["phase"] == "forward"]
    s = att["shapes"][0]
    assert s["attn"] == (2, 3, 32, 32, 8, 8) and s["causal"] is True
    # relu -> mul -> sum after the matmul is one chain (its first op reads, its last writes)
    chained = [r for r in rows if r["phase"] == "forward" and r.get("fused_kernels")]
    assert chained and sum(r["fused_kernels"] for r in chained) < sum(
        r["count"] for r in rows if r["phase"] == "forward" and r["kind"] not in ("matmul", "attention")
        and (r["bytes_read"] or r["bytes_written"]))


def test_a_first_step_is_priced_as_a_steady_one(audited, tmp_path):
    """A one-step audit's optimizer makes AdamW's state (exp_avg, exp_avg_sq: 2 zeros_like per
    parameter tensor; the step count: lift_fresh): later steps do not, so the prediction leaves
    those kernels out and equals a two-step audit's (whose last step holds the state)."""
    _, one = audited
    out = tmp_path / "two.json"
    res = CliRunner().invoke(cli, ["audit", TINY, "--steps", "2", "--gpu", "h100", "--format", "json",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    two = json.loads(out.read_text())
    made = [r for r in one["ops"] if r["phase"] == "optimizer" and r["op"].startswith("aten.zeros_like")]
    n_params = sum(1 for _ in _tiny_model().parameters())
    assert sum(r["count"] for r in made) == 2 * n_params
    p1, p2 = one["predictions"]["step_time"], two["predictions"]["step_time"]
    assert p1["by_phase"]["optimizer"] == pytest.approx(p2["by_phase"]["optimizer"])
    assert p1["seconds"] == pytest.approx(p2["seconds"])
    # 2 zeros_like + 1 lift_fresh per parameter tensor, and the foreach path's host scalar
    # (torch.tensor(1.0) on the CPU its step counts are added to: no GPU kernel either)
    assert f"made its state ({3 * n_params + 1} zero-fill and scalar kernels)" in " ".join(p1["assumptions"])


def _tiny_model():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpt2_tiny_example", TINY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.audit_spec().model
