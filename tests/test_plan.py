"""``torchledger plan`` (issue 35): the candidate space counted by hand, the ranking equal to a
brute-force audit of every layout, every printed figure reproduced by ``audit`` with the
row's audit_args, the rejected counted by reason, bad input one line and exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.plan.space import Candidate, ModelFacts, enumerate_space, factorisations

from _pipeline_models import TINY4     # llama-tiny, 4 blocks, 4 KV heads, 2 x 32 tokens
from _plan_helpers import cli_audit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: llama-tiny as bundled (2 blocks, 4 heads, 2 KV heads), one sequence of 32 tokens.
TINY2 = TINY4.replace('.replace(n_kv_heads=4, n_layers=4)', '').replace("(2, 32)", "(1, 32)")


def _write(tmp_path, text, name):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# -- the space, by hand -----------------------------------------------------------------------
def test_factorisations_by_hand():
    # 12 = 2^2 x 3 into 2 ordered factors: one per divisor of 12 (1, 2, 3, 4, 6, 12)
    assert factorisations(12, 2) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    # into 3: (2+2 choose 2) x (1+2 choose 2) = 6 x 3 = 18 ordered triples
    assert len(factorisations(12, 3)) == 18
    assert all(a * b * c == 12 for a, b, c in factorisations(12, 3))


def test_space_counted_by_hand():
    facts = ModelFacts(blocks=4, n_heads=4, n_kv_heads=2, d_ff=176, seq_len=32)
    space = enumerate_space(facts, gpus=4, global_batch=8)
    # (pp, dp, tp) with product 4: (1,1,4) (1,2,2) (1,4,1) (2,1,2) (2,2,1) (4,1,1); tp=4 does not
    # divide the 2 KV heads. The rest, micro-batch size b dividing 8 / dp, m = 8 / (dp b):
    #   pp1 dp2 tp2: b 1, 2, 4                      -> 3 splits
    #   pp1 dp4 tp1: b 1, 2                         -> 2
    #   pp2 dp1 tp2: b 1, 2, 4 (b 8: m 1 < pp 2)    -> 3, 1 refused by 1f1b
    #   pp2 dp2 tp1: b 1, 2 (b 4: m 1 < 2)          -> 2, 1 refused
    #   pp4 dp1 tp1: b 1, 2 (b 4, 8: m 2, 1 < 4)    -> 2, 2 refused
    # 12 splits x 2 policies (none, full) = 24 candidates; 4 refused by 1f1b
    assert len(space.candidates) == 24
    assert dict(space.rejected) == {"key/value heads 2 not divisible by tp=4": 1,
                                    "1f1b needs at least pp micro-batches": 4}
    assert all(c.global_batch == 8 for c in space.candidates)
    assert {c.schedule for c in space.candidates if c.size("pp") == 1} == {None}


def test_space_other_dims_and_schedules():
    facts = ModelFacts(blocks=8, n_heads=8, n_kv_heads=8, d_ff=64, seq_len=30, experts=0)
    space = enumerate_space(facts, gpus=4, global_batch=4, dims=("dp", "cp", "pp"),
                            checkpointing=("none",), schedules=("gpipe", "interleaved"))
    # cp=4 does not divide the sequence of 30 (cp=2 does); interleaved at pp=2 takes v = 2, 4
    # (8 % (2 v) == 0), at pp=4 v = 2 (8 % 8); gpipe takes any m
    assert space.rejected["sequence 30 not divisible by cp=4"] == 1
    pp2 = [c for c in space.candidates if c.mesh == "pp=2,dp=2,cp=1"]
    assert sorted({(c.schedule, c.virtual_stages) for c in pp2}) == [("gpipe", 1), ("interleaved", 2),
                                                                    ("interleaved", 4)]
    moe = enumerate_space(facts, gpus=2, global_batch=2, dims=("dp", "ep"))
    assert moe.rejected["ep=2 and the model has no experts"] == 1


def test_space_virtual_stages_and_held_sizes():
    # NeMo's Llama-3-70B: 80 blocks, pp=4 with 5 virtual stages (past MAX_VIRTUAL_STAGES = 4)
    facts = ModelFacts(blocks=80, n_heads=64, n_kv_heads=8, d_ff=28672, seq_len=8192)
    wide = enumerate_space(facts, gpus=8, global_batch=8, dims=("dp", "pp"), checkpointing=("none",),
                           schedules=("interleaved",), virtual_stages=(2, 5), fixed={"pp": 4})
    # held at pp=4: dp=2 only (dp x pp = 8); 8 / dp = 4 sequences a rank: b 1, 2, 4 -> m 4, 2, 1;
    # interleaved v 2 (80 % 8) and 5 (80 % 20): m 4 takes both (rounds 4 // 4 = 1); m 2 and 1 too
    # (max(1, m // 4) = 1 divides any m): 3 splits x 2 stage counts = 6 candidates
    assert {c.mesh for c in wide.candidates} == {"pp=4,dp=2"}
    assert sorted((c.micro_batch_size, c.virtual_stages) for c in wide.candidates) == [
        (1, 2), (1, 5), (2, 2), (2, 5), (4, 2), (4, 5)]
    assert not wide.rejected                           # the meshes not held are not counted
    # default stage counts 2..4: 80 % (4 v) == 0 for v 2 and 4 (not 3: 80 % 12 = 8)
    plain = enumerate_space(facts, gpus=8, global_batch=8, dims=("dp", "pp"), checkpointing=("none",),
                            schedules=("interleaved",), fixed={"pp": 4})
    assert sorted({c.virtual_stages for c in plain.candidates}) == [2, 4]
    for bad in ({"fixed": {"tp": 2}}, {"fixed": {"pp": 0}}, {"virtual_stages": (1,)}):
        with pytest.raises(ValueError):
            enumerate_space(facts, gpus=8, global_batch=8, dims=("dp", "pp"), **bad)


# -- the ranking is the brute-force audit's ------------------------------------------------------
def _audit_figures(path, mesh, b, ckpt, gpus, global_batch):
    """One layout audited directly (run_audit, then the prediction as `audit --gpu` makes it)."""
    from torchledger.audit.engine import run_audit
    from torchledger.steptime.predict import predict_into
    run = run_audit(path, steps=3, world_size=gpus, mesh=mesh,
                    plan={"micro_batch_size": b, "global_batch": global_batch, "checkpointing": ckpt,
                          "precision": "bf16-mixed", "kernels": "eager"})
    predict_into(run.record, "h100", {})
    return run.record.predictions["step_time"]["seconds"], run.record.totals["peak_bytes"]


def test_ranking_equals_brute_force(tmp_path):
    from torchledger.plan.search import search
    path = _write(tmp_path, TINY4, "tiny4.py")
    # 2 GPUs, dims dp, tp, global batch 4: dp=1,tp=2 takes b 1, 2, 4; dp=2,tp=1 takes b 1, 2;
    # x 2 policies = 10 layouts, listed here by hand and audited one by one
    layouts = [(mesh, b, ckpt) for mesh, bs in (("dp=1,tp=2", (1, 2, 4)), ("dp=2,tp=1", (1, 2)))
               for b in bs for ckpt in ("none", "full")]
    brute = {key: _audit_figures(path, *key, gpus=2, global_batch=4) for key in layouts}
    expected = sorted(layouts, key=lambda k: (brute[k][0], brute[k][1], k[0]))
    result = search(path, "h100", 2, 4, dims=("dp", "tp"), checkpointing=("none", "full"), top=20, jobs=2,
                    stderr=open(os.devnull, "w"))
    got = [(p["mesh"], p["micro_batch_size"], p["checkpointing"]) for p in result["plans"]]
    assert got == expected
    for p in result["plans"]:
        seconds, peak = brute[(p["mesh"], p["micro_batch_size"], p["checkpointing"])]
        # the plan traces two steps, the audit three: the second is as steady as the third
        assert p["step_seconds"] == pytest.approx(seconds, rel=1e-9)
        assert p["peak_bytes"] == peak
    assert result["traced"] == 10 and result["rejected"] == {}
    assert result["plans"][0]["versus_best"] == "best"


# -- every printed row is what `audit` says -----------------------------------------------------
@pytest.mark.parametrize("text,dims,ckpt,gpus,batch", [
    (TINY4, "dp,tp,pp", "none", 2, 4),        # pipeline and not: 7 candidates
    (TINY2, "dp,tp", "full,selective-op", 4, 4),
], ids=["tiny4-pipeline", "tiny2-checkpointing"])
def test_plan_rows_match_audit(tmp_path, text, dims, ckpt, gpus, batch):
    path = _write(tmp_path, text, "model.py")
    out = CliRunner().invoke(cli, ["plan", path, "--gpu", "h100", "--gpus", str(gpus),
                                                   "--global-batch", str(batch), "--dims", dims,
                                                   "--checkpointing", ckpt, "--top", "50", "--jobs", "2",
                                                   "--format", "json"], catch_exceptions=False)
    assert out.exit_code == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert len(plans) >= 4
    # the best, the worst, and a pipelined row where there is one
    sample = [plans[0], plans[-1]] + [p for p in plans if p["schedule"]][:1]
    for p in sample:
        seconds, peak = cli_audit(path, gpus, p["audit_args"])
        assert p["step_seconds"] == pytest.approx(seconds, rel=0.02), p["audit_args"]
        assert p["peak_bytes"] == pytest.approx(peak, rel=0.01), p["audit_args"]


# -- says why ---------------------------------------------------------------------------------
def test_rejected_by_reason_heads_not_divisible_by_three(tmp_path):
    path = _write(tmp_path, TINY2, "tiny.py")
    out = CliRunner().invoke(cli, ["plan", path, "--gpu", "h100", "--gpus", "6", "--global-batch",
                                                   "6", "--dims", "dp,tp", "--checkpointing", "none",
                                                   "--format", "json"], catch_exceptions=False)
    assert out.exit_code == 0, out.stderr
    got = json.loads(out.stdout)
    # (dp, tp) of 6: (1, 6) (2, 3) (3, 2) (6, 1); llama-tiny's 4 heads refuse tp 3 and 6
    assert got["rejected"] == {"attention heads 4 not divisible by tp=3": 1,
                               "attention heads 4 not divisible by tp=6": 1}
    # dp=3,tp=2: b 1, 2 (6 / 3 = 2 sequences a rank); dp=6,tp=1: b 1
    assert sorted((p["mesh"], p["micro_batch_size"]) for p in got["plans"]) == [
        ("dp=3,tp=2", 1), ("dp=3,tp=2", 2), ("dp=6,tp=1", 1)]
    assert got["searched"] == 5 and got["traced"] == 3 and got["composed"] == 3    # 2 blocks: traced whole
    # the JSON names of INTERFACE's "Plan"
    assert {"plans", "rejected", "searched", "traced", "seconds"} <= set(got)
    assert {"mesh", "virtual_stages", "micro_batch_size", "micro_batches", "checkpointing", "precision", "kernels",
            "schedule", "step_seconds", "tokens_per_s_per_gpu", "mfu", "peak_bytes", "fits", "versus_best",
            "audit_args"} <= set(got["plans"][0])


def test_nothing_fits_exit_1_and_larger_micro_batches_not_traced(tmp_path):
    path = _write(tmp_path, TINY2, "tiny.py")
    # 1e-6 of 80 GB = 80 kB: no layout fits; dp=1 takes b 1, 2, 4, the first over stops the chain
    out = CliRunner().invoke(cli, ["plan", path, "--gpu", "h100", "--gpus", "1", "--global-batch",
                                                   "4", "--dims", "dp", "--checkpointing", "none",
                                                   "--max-memory", "0.000001", "--format", "json"])
    assert out.exit_code == 1, out.stderr
    got = json.loads(out.stdout)
    assert got["traced"] == 1 and got["composed"] == 1
    assert got["rejected"] == {"does not fit 1e-06 of H100 SXM's memory": 1,
                               "does not fit: a smaller micro-batch of the layout did not (not traced)": 2}
    assert [p["fits"] for p in got["plans"]] == [False]


def test_versus_best_from_the_numbers():
    from torchledger.plan.search import versus_best
    best = {"step_seconds": 1.0, "comm_exposed_seconds": 0.1, "bubble_seconds": 0.0, "recompute_seconds": 0.0,
            "compute_seconds": 0.8, "launch_seconds": 0.1}
    # exposed communication 0.1 -> 0.21 s grew most (0.11 s): 2.1x; the step 1.0 -> 1.07 s: +7%
    row = dict(best, step_seconds=1.07, comm_exposed_seconds=0.21, compute_seconds=0.76)
    assert versus_best(row, best) == "+7%: exposed communication 2.1x the best's (210 vs 100 ms)"
    row = dict(best, step_seconds=1.3, bubble_seconds=0.3)
    assert versus_best(row, best) == "+30%: pipeline bubble 300 ms, the best has none"
    assert versus_best(best, best) == "best"
    # full checkpointing grows the compute by its recomputation: the two grow alike (the
    # compute a hair more by rounding) and the recomputation, the more specific, is named
    row = dict(best, step_seconds=1.23, recompute_seconds=0.2272264969, compute_seconds=0.8 + 0.2272264970)
    assert versus_best(row, best) == "+23%: recomputation 227 ms, the best has none"
    # a faster row (one that does not fit, set beside the best that does): a minus, not "+-"
    assert versus_best(dict(best, step_seconds=0.98), best) == "-2%: no part larger than the best's"


def test_frontier_by_hand():
    from torchledger.render.plan import frontier
    c = [{"fits": True, "peak_bytes": 10, "step_seconds": 3.0},
         {"fits": True, "peak_bytes": 20, "step_seconds": 2.0},
         {"fits": True, "peak_bytes": 30, "step_seconds": 2.5},     # beaten by #1 on both
         {"fits": False, "peak_bytes": 40, "step_seconds": 1.0},    # over the limit: not on it
         {"fits": True, "peak_bytes": 35, "step_seconds": 1.5}]
    assert frontier(c) == {0, 1, 4}


def test_micro_batch_size_resizes_the_inputs(tmp_path):
    from torchledger.audit.engine import run_audit
    path = _write(tmp_path, TINY2, "tiny.py")
    # the spec's 1 x 32 tokens repeated to 3 rows: 96 tokens; 6 sequences over dp=2 at 3 a rank: 1 micro-batch
    run = run_audit(path, steps=1, world_size=2, mesh="dp=2", plan={"micro_batch_size": 3, "global_batch": 6})
    assert run.record.totals["tokens"] == 3 * 32
    assert run.record.totals["micro_batches"] == 1


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--gpus", "4"], "--global-batch"),
    (["--gpus", "4", "--global-batch", "8", "--global-tokens", "256"], "one of"),
    (["--gpus", "4", "--global-batch", "8", "--dims", "dp,xx"], "--dims"),
    (["--gpus", "4", "--global-batch", "8", "--schedules", "fast"], "--schedules"),
    (["--gpus", "4", "--global-batch", "8", "--checkpointing", "none,none"], "twice"),
    (["--gpus", "0", "--global-batch", "8"], "--gpus"),
    (["--gpus", "4", "--global-batch", "8", "--seq", "64"], "--seq"),
    (["--gpus", "4", "--global-batch", "8", "--max-memory", "1.5"], "--max-memory"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, words):
    path = _write(tmp_path, TINY2, "tiny.py")
    code = ("import sys; from torchledger.cli import cli; "
            f"rc = cli.main({['plan', path, '--gpu', 'h100'] + args!r}, standalone_mode=False); "
            "print('torch' in sys.modules, rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr      # before torch is imported
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchledger: error:") and words in lines[0], lines


def test_unknown_gpu_and_missing_file_exit_2(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cli, ["plan", str(tmp_path / "none.py"), "--gpu", "h100", "--gpus", "2",
                              "--global-batch", "2"])
    assert out.exit_code == 2 and "no such file" in out.stderr
    path = _write(tmp_path, TINY2, "tiny.py")
    out = runner.invoke(cli, ["plan", path, "--gpu", "h999", "--gpus", "2", "--global-batch", "2"])
    assert out.exit_code == 2 and len(out.stderr.strip().splitlines()) == 1


def _result(plans_fit=True):
    row = {"mesh": "dp=2,tp=1", "virtual_stages": 1, "micro_batch_size": 1, "micro_batches": 2,
           "checkpointing": "none", "precision": "bf16-mixed", "kernels": "eager", "schedule": None,
           "step_seconds": 0.5, "tokens_per_s_per_gpu": 1000.0, "mfu": 0.4, "peak_bytes": 3 * 2 ** 30,
           "peak_rank": 0, "fits": plans_fit, "versus_best": "best", "audit_args": ["--mesh", "dp=2,tp=1"]}
    return {"plans": [row], "candidates": [row], "rejected": {"attention heads 4 not divisible by tp=3": 1},
            "searched": 2, "traced": 3, "composed": 1, "seconds": 1.0, "file": "m.py", "gpu": "H100 SXM", "gpu_flag": "h100",
            "gpus": 2, "global_batch": 4, "memory_limit_bytes": 2 * 2 ** 30 if not plans_fit else 72 * 10 ** 9}


@pytest.mark.parametrize("fmt", ["table", "json", "markdown", "html"])
def test_every_format_renders(fmt):
    from torchledger.render.plan import render_plan
    for fits in (True, False):
        text = render_plan(_result(fits), fmt)
        assert "dp=2,tp=1" in text
        if fmt == "json":
            assert "candidates" not in json.loads(text)
        if fmt == "html":
            assert text.count("<svg") == 1 and "memory limit" in text
        if fmt == "table":
            assert "3.0 GiB" in text and "attention heads 4 not divisible by tp=3" in text
            assert "searched 2 layouts, priced 1 from 3 traces, in 1 s" in text
            if not fits:      # 3 GiB against a 2 GiB limit: 1 GiB over
                assert "1.0 GiB over the limit" in text


# -- the published runs (benchmarks/plan_published.py) -------------------------------------------
def _plan_published():
    import importlib.util
    path = os.path.join(REPO, "benchmarks", "plan_published.py")
    spec = importlib.util.spec_from_file_location("plan_published_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_published_layout_is_one_candidate_of_its_search(tmp_path):
    from torchledger.formulas.hardware import get_gpu
    from torchledger.plan.evaluate import probe
    bench = _plan_published()
    with open(bench.DEFAULT_RUNS) as f:
        data = json.load(f)
    assert len(data["runs"]) == 12
    for run in data["runs"]:
        path = tmp_path / (run["id"].replace("-", "_") + ".py")
        path.write_text(bench.model_file(run, data["models"], micro=1, tokens=False))
        facts = probe(str(path))                  # on the meta device: no memory
        assert facts.batch == 1 and facts.seq_len == run["seq"], run["id"]
        pub, opts = bench.published(run), bench.search_options(run)
        space = enumerate_space(facts, run["gpus"], run["global_batch"], opts["dims"], opts["checkpointing"],
                                opts["schedules"], opts["precision"], opts["kernels"],
                                get_gpu(pub["gpu"]).gpus_per_node, opts["virtual_stages"])
        rows = [{"mesh": c.mesh, "micro_batch_size": c.micro_batch_size, "checkpointing": c.checkpointing,
                 "virtual_stages": c.virtual_stages, "schedule": c.schedule} for c in space.candidates]
        assert sum(bench.is_published(r, pub) for r in rows) == 1, run["id"]
    # NeMo's 70B: pp=4 x 5 virtual stages, past MAX_VIRTUAL_STAGES: tried as well as 2 to 4
    nemo = next(r for r in data["runs"] if r["id"] == "dgxc-l31-70b-h100-64")
    opts = bench.search_options(nemo)
    assert opts["virtual_stages"] == (2, 3, 4, 5) and opts["schedules"] == ("1f1b", "interleaved")
    assert opts["dims"] == ("dp", "pp", "dp_replicate", "cp", "tp") and opts["checkpointing"] == ("none", "full")


def test_published_row_against_the_best_in_words():
    bench = _plan_published()
    best = {"step_seconds": 1.0, "comm_exposed_seconds": 0.1, "bubble_seconds": 0.0, "recompute_seconds": 0.0,
            "compute_seconds": 0.8, "launch_seconds": 0.1, "fits": True, "audit_args": ["--mesh", "dp=8"],
            "peak_bytes": 50 * 2**30}
    assert bench.why(dict(best), best, 60 * 2**30) == "best"        # the same layout, a copy
    row = dict(best, step_seconds=1.3, bubble_seconds=0.3, audit_args=["--mesh", "pp=2,dp=4"])
    assert bench.why(row, best, 60 * 2**30) == "+30%: pipeline bubble 300 ms, the best has none"
    # 75 GiB against a 60 GiB limit: +25%; 0.9 s against 1.0 s: 10% shorter
    big = dict(row, fits=False, peak_bytes=75 * 2**30, step_seconds=0.9)
    assert bench.why(big, best, 60 * 2**30) == ("does not fit: peak 75.0 GiB over the 60.0 GiB limit (+25%); "
                                                "its step 10% shorter than the best's")
    assert bench.why(row, None, 1) == "nothing fits"
