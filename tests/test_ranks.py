"""Ranks: each record knows its rank, world size and mesh; ranks save their own files;
``report rank0.json rank1.json ...`` merges them (per-rank rows, skew, TL-RANK-*).

The real-ranks test launches examples/ddp_ranks.py once under torchrun (2 CPU ranks, gloo):
DDP and FSDP2 steps, each rank writes its record, the merge is checked against a
single-process trace of the same per-rank batch.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import torchledger
from torchledger.analyzers.ranks import DEFAULTS, RanksError, merge_ranks
from torchledger.cli import cli
from torchledger.record import StepRecord
from torchledger.render.ranks import RANK_COLUMNS, RANK_FORMATS, render_ranks
from torchledger.rules import title as rule_title
from torchledger.render.output import launcher_rank, rank_path
from torchledger.tracer.ranks import mesh_shape, rank_totals
from conftest import run_torchrun  # noqa: E402  (the shared torchrun launcher)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_ranks.py")
GPT2_TINY = os.path.join(ROOT, "tests", "data", "gpt2-tiny", "record.json")


def step_record(rank, world=4, *, flops=1000, peak=100, secs=1.0, comm=None, mesh="auto") -> StepRecord:
    rec = StepRecord()
    t = rec.totals
    t.update(rank=rank, world_size=world, mesh=[world] if mesh == "auto" else mesh, peak_bytes=peak,
             step_seconds=secs, param_bytes=40, grad_bytes=40, optimizer_state_bytes=80, tokens=8)
    t["flops"] = {"forward": flops // 3, "backward": flops - flops // 3, "optimizer": 0, "total": flops, "other": 0}
    if comm is not None:
        t["comm_bytes"] = {"forward": 0, "backward": comm, "optimizer": 0, "other": 0, "total": comm}
    return rec


def rules(merged) -> list:
    return [f.rule for f in merged["findings"]]


# -- which rank: totals.rank, world_size, mesh ------------------------------------------------
def test_one_process_is_rank_0_of_1_without_a_mesh():
    assert rank_totals() == {"rank": 0, "world_size": 1, "mesh": None}
    assert rank_totals((2, 4)) == {"rank": 0, "world_size": 1, "mesh": [2, 4]}   # a shape given: kept
    m = nn.Linear(3, 2)
    with torchledger.trace(m) as t:
        m(torch.ones(1, 3)).sum().backward()
    assert {k: t.record.totals[k] for k in ("rank", "world_size", "mesh")} == \
        {"rank": 0, "world_size": 1, "mesh": None}


def test_a_bad_mesh_is_refused_before_the_step():
    with pytest.raises(TypeError, match="expected a DeviceMesh or a shape"):
        torchledger.trace(nn.Linear(2, 2), mesh="8x8")
    with pytest.raises(TypeError, match="expected a DeviceMesh or a shape"):
        torchledger.Ledger(nn.Linear(2, 2), mesh=object())
    assert mesh_shape(None) is None and mesh_shape([8, 8]) == [8, 8]


def test_old_records_load_as_rank_0_of_1():
    with open(GPT2_TINY, encoding="utf-8") as fh:
        d = json.load(fh)
    for key in ("rank", "world_size", "mesh"):
        d["totals"].pop(key, None)
    t = StepRecord.from_dict(d).totals
    assert (t["rank"], t["world_size"], t["mesh"]) == (0, 1, None)


def test_a_mesh_must_hold_the_world():
    with open(GPT2_TINY, encoding="utf-8") as fh:
        d = json.load(fh)
    d["totals"].update(rank=5, world_size=8, mesh=[2, 4])
    assert StepRecord.from_dict(copy.deepcopy(d)).totals["mesh"] == [2, 4]
    d["totals"]["mesh"] = [2, 3]                             # 2 * 3 = 6 ranks, not 8
    with pytest.raises(ValueError, match=r"totals.mesh: expected a mesh shape whose sizes multiply to "
                                         r"totals.world_size \(8\), got \[2, 3\]"):
        StepRecord.from_dict(d)


def test_under_a_process_group_the_record_names_rank_world_and_mesh():
    """A fake process group (rank 2 of 4, one process): the traced step's record says so; the
    mesh is [world] by default, the DeviceMesh given, or the FSDP2 parameters' mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        m = nn.Linear(4, 3)
        with torchledger.trace(m) as t:
            m(torch.ones(2, 4)).sum().backward()
        assert {k: t.record.totals[k] for k in ("rank", "world_size", "mesh")} == \
            {"rank": 2, "world_size": 4, "mesh": [4]}
        assert t.record.totals["flops"]["forward"] == 48          # 2 * 2*4*3: the step, as in one process
        mesh = init_device_mesh("cpu", (2, 2))
        ledger = torchledger.Ledger(m, mesh=mesh)
        with ledger.step():
            m(torch.ones(2, 4)).sum().backward()
        assert ledger.records[-1].totals["mesh"] == [2, 2]
        sharded = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=init_device_mesh("cpu", (4,)))
        assert rank_totals(model=sharded)["mesh"] == [4]
    finally:
        dist.destroy_process_group()
    assert rank_totals() == {"rank": 0, "world_size": 1, "mesh": None}


# -- where each rank writes ---------------------------------------------------------------------
def test_rank_paths(tmp_path):
    assert rank_path("runs/rank{rank}.json", 3, 8) == "runs/rank3.json"
    assert rank_path(str(tmp_path), 3, 8) == os.path.join(str(tmp_path), "rank3.json")
    assert rank_path("step.json", 1, 2) == "step.rank1.json"
    assert rank_path("step.json", 0, 1) == "step.json"                 # one process: as given


def test_record_save_writes_the_rank_file(tmp_path):
    rec = step_record(1, world=2)
    path = rec.save(tmp_path / "step.json")
    assert path == str(tmp_path / "step.rank1.json")
    assert StepRecord.from_json(open(path, encoding="utf-8").read()).totals["rank"] == 1
    assert step_record(0, world=2).save(tmp_path) == str(tmp_path / "rank0.json")
    with pytest.raises(RuntimeError, match="no step traced yet"):
        torchledger.Ledger(nn.Linear(2, 2)).save(tmp_path)


def test_launcher_rank_reads_torchruns_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launcher_rank() == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launcher_rank() is None
    monkeypatch.delenv("RANK")
    assert launcher_rank() is None


def test_audit_output_under_torchrun_gets_the_rank_suffix(tmp_path, monkeypatch):
    model = tmp_path / "m.py"
    model.write_text("import torch, torch.nn as nn, torchledger\n"
                     "def audit_spec():\n"
                     "    return torchledger.AuditSpec(nn.Linear(4, 3), torch.ones(2, 4))\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out.json"
    r = CliRunner().invoke(cli, ["audit", str(model), "--steps", "1", "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert not out.exists() and (tmp_path / "out.rank1.json").exists()
    assert json.loads((tmp_path / "out.rank1.json").read_text())["totals"]["flops"]["forward"] == 48


# -- the merge: hand-checked --------------------------------------------------------------------
def test_skew_and_findings_by_hand():
    recs = [step_record(0), step_record(1), step_record(2), step_record(3, peak=130, secs=1.5, flops=1100)]
    m = merge_ranks(recs, names=[f"r{i}" for i in range(4)])
    assert [row["rank"] for row in m["ranks"]] == [0, 1, 2, 3] and m["missing_ranks"] == []
    # peaks 100, 100, 100, 130: median 100; 130/100 = 1.3; rank 3 is 30% above (> 10%)
    assert m["skew"]["peak_bytes"] == {"max": 130, "min": 100, "median": 100.0, "max_rank": 3, "min_rank": 0,
                                       "max_over_min": 1.3, "max_over_median": 1.3, "ranks": 4}
    # times 1, 1, 1, 1.5: 50% above the median (> 20%); FLOPs 1100 / 1000 = 1.1x (> 1.05)
    assert m["skew"]["step_seconds"]["max_over_median"] == 1.5
    assert m["skew"]["flops"]["max_over_min"] == 1.1
    assert m["skew"]["comm_bytes"]["max"] == 0                    # one process each: no collectives
    for r in recs:
        del r.totals["comm_bytes"]                                  # records made before comm_bytes
    assert merge_ranks(recs)["skew"]["comm_bytes"]["max"] is None
    assert rules(m) == ["TL-RANK-001", "TL-RANK-002", "TL-RANK-003"]
    f = m["findings"][0]
    assert "rank 3's peak 130 B is 30% above the median rank's 100 B" in f.message
    assert (f.measured, f.expected) == (130, 100.0)


def test_below_the_thresholds_nothing_fires():
    # peak 109 vs median 100: 9% (< 10%); 1.19 s: 19% (< 20%); FLOPs 1040/1000 = 1.04x (< 1.05)
    recs = [step_record(0), step_record(1), step_record(2), step_record(3, peak=109, secs=1.19, flops=1040)]
    assert rules(merge_ranks(recs)) == []
    tighter = merge_ranks(recs, options={"rank_peak_skew": 0.05, "rank_flops_skew": 0.01})
    assert rules(tighter) == ["TL-RANK-001", "TL-RANK-003"]
    assert set(DEFAULTS) == {"rank_peak_skew", "rank_time_skew", "rank_flops_skew"}


def test_two_ranks_compare_with_their_mean():
    # world of 2: median = (100 + 125) / 2 = 112.5; 125 / 112.5 = 1.111: 11% above (> 10%)
    m = merge_ranks([step_record(0, 2, peak=100), step_record(1, 2, peak=125)])
    assert m["skew"]["peak_bytes"]["median"] == 112.5 and rules(m) == ["TL-RANK-001"]


def test_comm_bytes_are_compared_when_the_records_have_them():
    # 4096 and 6144 bytes sent: 6144 / 4096 = 1.5
    m = merge_ranks([step_record(0, 2, comm=4096), step_record(1, 2, comm=6144)])
    assert [row["comm_bytes"] for row in m["ranks"]] == [4096, 6144]
    assert m["skew"]["comm_bytes"]["max_over_min"] == 1.5 and m["skew"]["comm_bytes"]["max_rank"] == 1


def test_missing_ranks_are_listed():
    m = merge_ranks([step_record(2), step_record(0)])
    assert [row["rank"] for row in m["ranks"]] == [0, 2] and m["missing_ranks"] == [1, 3]
    assert "missing ranks: 1, 3 (2 of 4)" in render_ranks(m, "table")


def test_a_huge_world_lists_its_first_missing_ranks_only():
    m = merge_ranks([step_record(1, 2**62, mesh=None)])          # a record's world size is input
    assert m["missing_count"] == 2**62 - 1 and m["missing_ranks"][:3] == [0, 2, 3]
    assert len(m["missing_ranks"]) == 1024


def test_rank_detection_that_fails_gives_rank_0_of_1(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1 / 0)          # a half-torn-down group
    m = nn.Linear(3, 2)
    with torchledger.trace(m) as t:
        m(torch.ones(1, 3)).sum().backward()
    assert (t.record.totals["rank"], t.record.totals["world_size"]) == (0, 1)


@pytest.mark.parametrize("records, needle", [
    ([step_record(0, 2), step_record(1, 4)], "world sizes differ: 2 (a), 4 (b)"),
    ([step_record(1, 2), step_record(1, 2)], "rank 1 given twice: a and b"),
    ([step_record(0, 1, mesh=None), step_record(0, 1, mesh=None)], "single-process steps are all rank 0 of 1"),
    ([step_record(0, 4, mesh=[2, 2]), step_record(1, 4, mesh=[4])], "meshes differ"),
])
def test_not_one_run_is_refused(records, needle):
    with pytest.raises(RanksError, match=None) as e:
        merge_ranks(records, names=["a", "b"])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", sorted(RANK_FORMATS))
def test_every_format_renders(fmt):
    m = merge_ranks([step_record(0), step_record(1, peak=200), step_record(3)])
    text = render_ranks(m, fmt)
    if fmt == "json":
        d = json.loads(text)
        assert d["schema"] == "torchledger.ranks/1" and {"ranks", "skew", "findings"} <= set(d)
        assert d["findings"][0]["rule"] == "TL-RANK-001"
    elif fmt == "sarif":
        rule = json.loads(text)["runs"][0]["tool"]["driver"]["rules"][0]
        assert rule["shortDescription"]["text"] == rule_title("TL-RANK-001")
    elif fmt == "csv":
        assert text.splitlines()[0] == ",".join(RANK_COLUMNS) and len(text.splitlines()) == 4
    else:
        assert "TL-RANK-001" in text and "missing ranks: 2" in text


# -- the CLI ------------------------------------------------------------------------------------
def save_all(tmp_path, records) -> list:
    return [r.save(tmp_path / "rank{rank}.json") for r in records]


def report(*args):
    return CliRunner().invoke(cli, ["report", *map(str, args)])


def test_cli_merges_and_warns_on_missing_ranks(tmp_path):
    paths = save_all(tmp_path, [step_record(0), step_record(1), step_record(2, secs=2.0)])
    r = report(*paths, "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [row["rank"] for row in d["ranks"]] == [0, 1, 2] and d["missing_ranks"] == [3]
    assert d["missing_count"] == 1                                      # 4 ranks, 3 given
    # 2.0 s: 100% over the median 1.0 s; rank 3 of 4 has no record
    assert [f["rule"] for f in d["findings"]] == ["TL-RANK-002", "TL-RANK-004"]
    assert "1 of 4 ranks missing (rank 3)" in r.stderr


def test_cli_thresholds_and_ignore_from_pyproject(tmp_path, monkeypatch):
    # peaks 100 and 108: median 104, 108/104 = 1.038: under the default 10%, over 3%
    paths = save_all(tmp_path, [step_record(0, 2), step_record(1, 2, peak=108)])
    monkeypatch.chdir(tmp_path)
    assert json.loads(report(*paths, "--format", "json").stdout)["findings"] == []
    (tmp_path / "pyproject.toml").write_text("[tool.torchledger]\nrank_peak_skew = 0.03\n")
    d = json.loads(report(*paths, "--format", "json").stdout)
    assert [f["rule"] for f in d["findings"]] == ["TL-RANK-001"]
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nrank_peak_skew = 0.03\nignore = ["TL-RANK-001"]\n')
    assert json.loads(report(*paths, "--format", "json").stdout)["findings"] == []
    (tmp_path / "pyproject.toml").write_text("[tool.torchledger]\nrank_time_skew = 2\n")
    r = report(*paths)
    assert r.exit_code == 2 and "rank_time_skew: expected a fraction such as 0.2, got 2" in r.stderr


@pytest.mark.parametrize("case, needle", [
    ("mixed", "world sizes differ"), ("duplicate", "rank 0 given twice"), ("unreadable", "no such file"),
    ("html", "merged ranks render as table, json, csv, markdown, sarif"),
])
def test_cli_bad_inputs_are_one_line_exit_2(tmp_path, case, needle):
    a, b = save_all(tmp_path, [step_record(0, 2), step_record(1, 2)])
    args = {"mixed": [a, GPT2_TINY], "duplicate": [GPT2_TINY, GPT2_TINY],
            "unreadable": [a, tmp_path / "rank9.json"], "html": [a, b, "--format", "html"]}[case]
    r = report(*args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output and needle in err, err


def test_one_record_renders_as_before():
    r = report(GPT2_TINY)
    with open(os.path.join(ROOT, "tests", "golden", "gpt2-tiny.txt"), encoding="utf-8") as fh:
        assert r.exit_code == 0 and r.stdout == fh.read()


# -- real ranks: torchrun, 2 CPU processes over gloo ---------------------------------------------
@pytest.fixture(scope="module")
def torchrun_records(tmp_path_factory):
    """examples/ddp_ranks.py under torchrun: runs/{ddp,fsdp}/rank{0,1}.json."""
    out = tmp_path_factory.mktemp("ranks")
    run_torchrun(EXAMPLE, out)
    return out


def single_process_flops() -> int:
    """The same model and per-rank batch, traced in this process without any wrapper."""
    spec = importlib.util.spec_from_file_location("ddp_ranks", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    model = ex.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torchledger.trace(model, opt, tokens=ex.BATCH) as t:
        model(ex.batch(0)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return t.record.totals["flops"]["total"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_torchrun_ranks_merge(torchrun_records, kind):
    paths = [torchrun_records / kind / f"rank{r}.json" for r in (1, 0)]       # any order
    r = report(*paths, "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["world_size"] == 2 and d["mesh"] == [2] and d["missing_ranks"] == []
    rows = d["ranks"]
    assert [row["rank"] for row in rows] == [0, 1]
    assert rows[0]["param_bytes"] == rows[1]["param_bytes"] > 0
    # forward 2*4*8*16 + 2*4*16*4 = 1536; backward: both weight grads (1024 + 512) and the
    # second layer's input grad (512) = 2048; 3584 on each rank, as in one process
    flops = single_process_flops()
    assert flops == 3584 and [row["flops"] for row in rows] == [flops, flops]
    assert d["skew"]["flops"]["max_over_min"] == 1.0
    table = report(*paths)
    assert table.exit_code == 0 and "2 of 2 ranks (world size 2, mesh [2])" in table.stdout
    # per-rank static bytes and comm by hand: 212 parameters (8*16 + 16 + 16*4 + 4), fp32
    full = 212 * 4                                                   # 848 B
    for path in paths:
        rec = json.loads(path.read_text())
        t = rec["totals"]
        shard = full if kind == "ddp" else full // 2                # FSDP2: 8+8 / 2+2 rows each
        assert (t["param_bytes"], t["grad_bytes"]) == (shard, shard)
        assert t["optimizer_state_bytes"] == 2 * shard + 4 * 4       # AdamW m, v + 4 step scalars
        assert t["matmul_params"] == 8 * 16 + 16 * 4                 # N of 6ND: the unsharded weights
        sent = {}
        for c in rec["collectives"]:
            sent[(c["op"], c["phase"])] = sent.get((c["op"], c["phase"]), 0) + c["bytes"]
        if kind == "ddp":                                            # one all-reduce of the gradients
            assert sent == {("all_reduce", "backward"): full}
        else:            # all-gather the shards in forward and backward, reduce-scatter the grads
            assert sent == {("all_gather", "forward"): full // 2, ("all_gather", "backward"): full // 2,
                            ("reduce_scatter", "backward"): full}
        assert t["comm_bytes"]["total"] == sum(sent.values())
    for rank, row in enumerate(rows):
        rec = StepRecord.from_json((torchrun_records / kind / f"rank{rank}.json").read_text())
        assert (rec.totals["rank"], rec.totals["world_size"]) == (rank, 2)
        assert row["step_seconds"] == rec.totals["step_seconds"] > 0


def test_report_fail_on_gates_a_merge_and_a_record(tmp_path):
    # rank 2's step takes 2.0 s against a median of 1.0 s: TL-RANK-002 (warning)
    paths = save_all(tmp_path, [step_record(0), step_record(1), step_record(2, secs=2.0), step_record(3)])
    assert report(*paths).exit_code == 0                                  # default: never
    assert report(*paths, "--fail-on", "warning").exit_code == 1
    assert report(*paths, "--fail-on", "error").exit_code == 0
    # one record: its stored findings gate the same way (cruncher-copy has TL-COPY-003, a warning)
    one = os.path.join(os.path.dirname(__file__), "data", "cruncher-copy", "record.json")
    assert report(one, "--fail-on", "warning").exit_code == 1
    assert report(one, "--fail-on", "error").exit_code == 0
    assert report(one).exit_code == 0
