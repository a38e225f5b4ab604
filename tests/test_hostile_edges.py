"""Faults on the newer surfaces (issue 21 items 3-5): settings and units that lied or gave
tracebacks, clocks that return NaN/inf or go backwards, the largest simulated world."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import torchledger
from torchledger.cli import cli
from torchledger.cli.types import BANDWIDTH
from torchledger.render.trace_events import render_trace
from torchledger.settings import SettingsError, load_settings
from torchledger.units import parse_bandwidth
from torchledger.audit.world import MAX_WORLD, WorldError, parse_mesh


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity (what Perfetto and other parsers do)."""
    def refuse(name):
        raise ValueError(f"invalid JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


# -- item 4: settings and units -----------------------------------------------------------
@pytest.mark.parametrize("text, bytes_per_s", [
    ("450GB/s", 450e9), ("450Gb/s", 450e9 / 8),     # b is bits: 450 Gb/s = 56.25 GB/s
    ("400Gbps", 50e9), ("400Gbit/s", 50e9), ("400 Gbit/s", 50e9), ("450GBps", 450e9),
    ("450GB", 450e9), ("450G", 450e9), ("4.5e11", 4.5e11), ("1GiB/s", 2**30),
    ("8Kib/s", 1024),                              # 8 * 1024 bits = 1024 bytes
])
def test_bandwidth_reads_bits_and_bytes(text, bytes_per_s):
    assert parse_bandwidth(text) == bytes_per_s
    assert BANDWIDTH.convert(text, None, None) == bytes_per_s


@pytest.mark.parametrize("text", ["450XB/s", "nan", "GB/s", "450GB/h"])
def test_a_bad_bandwidth_is_a_value_error(text):
    with pytest.raises(ValueError, match="450GB/s"):
        parse_bandwidth(text)


def settings_from(tmp_path, text):
    (tmp_path / "pyproject.toml").write_text(text)
    return load_settings(str(tmp_path))


@pytest.mark.parametrize("body, needle", [
    ("[tool.torchledger]\nmax_params = inf\n", "max_params: expected a count"),
    ("[tool.torchledger]\nmax_peak_bytes = inf\n", "max_peak_bytes: expected a size"),
    ("[tool.torchledger]\nmax_flops_per_token = nan\n", "max_flops_per_token"),
    ("[tool.torchledger]\nleak_min_bytes = inf\n", "leak_min_bytes"),
    ("tool = 1\n", "[tool] must be a table"),
    ('tool = "x"\n', "got tool = 'x'"),
])
def test_settings_that_never_fail_or_crash_are_one_line(tmp_path, body, needle):
    with pytest.raises(SettingsError) as e:
        settings_from(tmp_path, body)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_tool_1_in_pyproject_is_exit_2_for_report(tmp_path, monkeypatch):
    from test_ranks import step_record
    (tmp_path / "pyproject.toml").write_text("tool = 1\n")
    monkeypatch.chdir(tmp_path)
    paths = [step_record(r, 2).save(tmp_path / f"rank{r}.json") for r in (0, 1)]
    r = CliRunner().invoke(cli, ["report", *paths])
    assert r.exit_code == 2 and "[tool] must be a table" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("mesh", ["1" * 5000, "9" * 8, "x".join(["1"] * (9)), "1" * 5000 + "x2"])
def test_a_huge_mesh_is_one_short_line(mesh):
    with pytest.raises(WorldError) as e:
        parse_mesh(mesh)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 200 and f"{MAX_WORLD:,}" in msg, msg


def test_leading_zeros_and_eight_dims_still_parse():
    assert parse_mesh("0001x2") == (1, 2)
    assert parse_mesh("x".join(["1"] * 8)) == (1,) * 8


def test_a_huge_mesh_on_the_command_line_is_exit_2(tmp_path):
    from test_audit_cli import one_line_error
    model = tmp_path / "m.py"
    model.write_text("def audit_spec():\n    raise SystemExit('not reached')\n")
    one_line_error(CliRunner().invoke(cli, ["audit", str(model), "--mesh", "1" * 5000]),
                   "--mesh", "(5,000 characters)")


# -- item 5: clocks -----------------------------------------------------------------------
def one_step(clock):
    model = nn.Linear(4, 3)
    with torchledger.trace(model, peak_flops=1e9, clock=clock) as t:
        model(torch.ones(2, 4)).sum().backward()
    return t.record


def ticks(*values):
    it = iter(values)
    return lambda: next(it)


@pytest.mark.parametrize("start, end, shown", [
    (0.0, math.nan, "nan"), (0.0, math.inf, "inf"), (5.0, 2.0, "-3.0"),      # backwards: 2 - 5
    (-math.inf, 0.0, "inf"),
])
def test_a_clock_that_lies_leaves_the_time_out_with_a_warning(start, end, shown):
    rec = one_step(ticks(start, end))
    assert rec.totals["step_seconds"] is None and rec.totals.get("mfu") is None
    (warning,) = [w for w in rec.warnings if w.startswith("step time left out")]
    assert shown in warning and "time.perf_counter" in warning
    doc = strict_json(rec.to_json())                          # valid JSON, no NaN/Infinity
    assert doc["totals"]["step_seconds"] is None
    strict_json(render_trace(rec))
    from torchledger.record import StepRecord
    StepRecord.from_json(rec.to_json())                       # report loads it


def test_a_clock_that_raises_at_the_end_keeps_the_record():
    calls = []

    def clock():
        calls.append(1)
        if len(calls) > 1:
            raise OSError("clock gone")
        return 0.0
    rec = one_step(clock)
    assert rec.totals["step_seconds"] is None and rec.totals["flops"]["total"] == 2 * 2 * 4 * 3 * 2
    assert any("the clock raised OSError: clock gone" in w for w in rec.warnings)


def test_a_good_clock_still_times_the_step():
    rec = one_step(ticks(1.0, 1.5))
    assert rec.totals["step_seconds"] == 0.5
    assert not [w for w in rec.warnings if w.startswith("step time left out")]


def test_ledger_untraced_times_skip_a_clock_gone_backwards():
    model = nn.Linear(4, 3)
    ledger = torchledger.Ledger(model, sample_every=2, clock=ticks(0.0, 1.0, 5.0, 2.0, 2.0, 2.5, 3.0, math.nan))
    for _ in range(4):
        with ledger.step():
            model(torch.ones(2, 4)).sum().backward()
    # step 1 (untraced): 2.0 - 5.0 < 0 left out; step 3: nan left out
    assert ledger.untraced_seconds == []
    assert [r.totals["step_seconds"] for r in ledger.records] == [1.0, 0.5]


# -- item 3: the largest simulated world --------------------------------------------------
def test_the_simulated_world_makes_only_the_chunks_fsdp_reads():
    """FSDP2 chunks each parameter into one view per rank and pads the list with a fake
    new_empty(0) per missing rank: twice per parameter per rank made --world-size 1048576 run
    for more than 300 s. In a simulated world the chunk list makes each chunk when it is
    read (the same shapes torch.chunk gives); the original comes back after."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchledger.audit.world import fake_world
    original = _fsdp_param._chunk_with_empty
    with fake_world(4096, (4096,)):
        with FakeTensorMode():
            t = torch.ones(3, 2)
            chunks = _fsdp_param._chunk_with_empty(t, 4096, 0)
            assert not isinstance(chunks, list)                     # nothing made up front
            assert len(chunks) == 4096 and [tuple(c.shape) for c in chunks[:4]] == [(1, 2)] * 3 + [(0,)]
            assert tuple(chunks[-1].shape) == (0,) and tuple(chunks[2].shape) == (1, 2)
            # as torch.chunk pads: 7 rows over 4 ranks are chunks of 2, 2, 2, 1
            seven = _fsdp_param._chunk_with_empty(torch.ones(7, 2), 4, 0)
            assert [c.shape[0] for c in seven] == [2, 2, 2, 1]
    assert _fsdp_param._chunk_with_empty is original


# -- item 3: distributed faults -----------------------------------------------------------
def report(*args):
    return CliRunner().invoke(cli, ["report", *map(str, args)])


def test_one_record_of_a_two_rank_run_says_rank_1_is_missing(tmp_path):
    from test_ranks import step_record
    path = step_record(0, 2).save(tmp_path / "rank{rank}.json")
    r = report(path, "--format", "json")
    assert r.exit_code == 0, r.output
    (f,) = json.loads(r.stdout)["findings"]
    assert f["rule"] == "TL-RANK-004" and f["message"].startswith("rank 1 of 2 missing")
    assert report(path, "--fail-on", "warning").exit_code == 1
    assert "TL-RANK-004" in report(path).stdout


def test_a_simulated_world_and_one_process_miss_no_rank(tmp_path):
    from test_ranks import GPT2_TINY, step_record
    sim = step_record(0, 8)
    sim.meta["audit"] = {"world_size": 8, "rank": 0, "mesh": [8]}       # audit --world-size 8
    path = sim.save(tmp_path / "sim.json")
    assert report(path, "--fail-on", "info").exit_code == 0
    assert report(GPT2_TINY, "--fail-on", "info").exit_code == 0        # rank 0 of 1


def test_a_merge_with_ranks_missing_gates_with_fail_on(tmp_path):
    from test_ranks import step_record
    paths = [step_record(r, 4).save(tmp_path / f"rank{r}.json") for r in (0, 2)]
    r = report(*paths, "--format", "json")
    d = json.loads(r.stdout)
    assert [f["rule"] for f in d["findings"]] == ["TL-RANK-004"]
    assert d["findings"][0]["message"].startswith("2 of 4 ranks missing (rank 1, 3)")
    assert report(*paths, "--fail-on", "warning").exit_code == 1


def test_ledger_save_to_keeps_the_last_completed_step_when_a_step_raises(tmp_path):
    """A rank whose later step fails (a peer died in a collective) keeps its last completed
    traced step on disk: saved as that step ended, not overwritten by the failed one."""
    model = nn.Linear(4, 3)
    ledger = torchledger.Ledger(model, save_to=tmp_path / "runs" / "rank{rank}.json")
    with ledger.step():
        model(torch.ones(2, 4)).sum().backward()
    path = tmp_path / "runs" / "rank0.json"
    assert ledger.saved == [str(path)] and json.loads(path.read_text())["meta"]["step_index"] == 0
    with pytest.raises(RuntimeError, match="peer died"):
        with ledger.step():
            model(torch.ones(2, 4))
            raise RuntimeError("peer died")
    assert len(ledger.records) == 2                                   # traced, but not saved
    assert json.loads(path.read_text())["meta"]["step_index"] == 0
    with ledger.step():
        model(torch.ones(2, 4)).sum().backward()
    assert json.loads(path.read_text())["meta"]["step_index"] == 2


def test_ledger_save_to_under_a_process_group_writes_the_rank_file(tmp_path):
    """Rank 0 of 2 (a fake process group): the record says world_size 2 and lands in
    rank0.json; report on it alone finds rank 1 missing."""
    from torchledger.audit.world import fake_world
    model = nn.Linear(4, 3)
    with fake_world(2, (2,)):
        ledger = torchledger.Ledger(model, save_to=str(tmp_path) + "/step{step}/")
        with ledger.step():
            model(torch.ones(2, 4)).sum().backward()
    (path,) = ledger.saved
    assert path == str(tmp_path / "step0" / "rank0.json")
    assert report(path, "--fail-on", "warning").exit_code == 1


def test_ledger_save_to_that_cannot_write_warns_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    model = nn.Linear(4, 3)
    ledger = torchledger.Ledger(model, save_to=blocker / "sub" / "r.json")
    with pytest.warns(RuntimeWarning, match="step 0's record not saved"):
        with ledger.step():
            model(torch.ones(2, 4)).sum().backward()
    assert ledger.saved == [] and len(ledger.records) == 1


# -- item 7: integrations, minor ----------------------------------------------------------
def test_a_newline_in_a_rank_file_name_stays_in_its_row(tmp_path):
    from test_ranks import step_record
    from torchledger.analyzers.ranks import merge_ranks
    from torchledger.render.ranks import render_ranks
    names = ["run\nA/rank0.json", "run\x1b[31mB/rank1.json"]
    merged = merge_ranks([step_record(0, 3), step_record(1, 3)], names=names)
    table = render_ranks(merged, "table")
    rows = [line for line in table.splitlines() if "rank0.json" in line or "rank1.json" in line]
    assert [r.split()[-1] for r in rows[:2]] == ["run\\nA/rank0.json", "run\\x1b[31mB/rank1.json"]
    assert all(line.isprintable() for line in table.splitlines())
    (f,) = merged["findings"]                                        # rank 2 of 3 missing
    assert "run\\nA/rank0.json" in f.message and "\n" not in f.message
    assert json.loads(render_ranks(merged, "json"))["ranks"][0]["file"] == names[0]   # data kept as given
    from torchledger.analyzers.ranks import RanksError
    with pytest.raises(RanksError) as e:
        merge_ranks([step_record(0, 2), step_record(0, 2)], names=["a\nb", "c"])
    assert "\n" not in str(e.value)


def test_a_crafted_segment_cannot_draw_an_op_outside_its_phase():
    from test_ranks import GPT2_TINY
    from torchledger.record import StepRecord
    with open(GPT2_TINY, encoding="utf-8") as fh:
        d = json.load(fh)
    # forward holds ops 0..2, but its one run claims 5 ops (it would end at 5, inside backward)
    d["memory"]["segments"] = [
        {"start": 0, "end": 2, "phase": "forward", "module": None, "ops": [["aten.mm.default", 5, 10]]},
        {"start": 2, "end": 4, "phase": "backward", "module": None, "ops": [["aten.mm.default", 2, 20]]}]
    doc = strict_json(render_trace(StepRecord.from_dict(d)))
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    phases = [e for e in slices if e["cat"] == "phase"]
    for op in (e for e in slices if e["cat"] == "op"):
        (phase,) = [p for p in phases if p["name"] == op["args"]["phase"]]
        assert phase["ts"] <= op["ts"] and op["ts"] + op["dur"] <= phase["ts"] + phase["dur"], (op, phase)
    assert [(p["name"], p["ts"], p["dur"]) for p in phases] == [("backward", 2, 2)]


def run_steps(run, model, labels, out_dir):
    for label in labels:
        run.begin(model, None)
        run.open(label)
        model(torch.ones(2, 4)).sum().backward()
        run.close(out_dir)


def test_a_resumed_run_keeps_the_first_runs_records_and_numbers_on(tmp_path):
    """A first run writes steps 1-4; a run resumed from the checkpoint at step 2 redoes 3-4
    and goes on to 6: the first run's files stay, the resumed ones are step_000003.1.json ...,
    and each record's meta.step_index is its global step - 1 (it restarted at 0)."""
    from torchledger.integrations._common import RECORDS_DIR, LedgerRun
    model = nn.Linear(4, 3)
    run_steps(LedgerRun("test", sample_every=1), model, [1, 2, 3, 4], tmp_path)
    folder = tmp_path / RECORDS_DIR
    first = {p.name: p.read_text() for p in folder.iterdir()}
    resumed = LedgerRun("test", sample_every=1)
    run_steps(resumed, model, [3, 4, 5, 6], tmp_path)
    assert [os.path.basename(p) for p in resumed.written] == [
        "step_000003.1.json", "step_000004.1.json", "step_000005.json", "step_000006.json"]
    assert all((folder / name).read_text() == text for name, text in first.items())   # untouched
    index = {p: json.loads(open(p).read())["meta"]["step_index"] for p in resumed.written}
    assert list(index.values()) == [2, 3, 4, 5]
    assert json.loads((folder / "step_000001.json").read_text())["meta"]["step_index"] == 0


def test_a_resumed_run_samples_the_global_steps_a_fresh_run_would():
    from torchledger.integrations._common import LedgerRun
    model = nn.Linear(4, 3)
    run = LedgerRun("test", sample_every=3, write=False)
    traced = []
    for label in range(5, 11):                  # resumed at global step 4: steps 5..10
        run.begin(model, None)
        run.open(label)
        traced.append(run.tracing)
        model(torch.ones(2, 4)).sum().backward()
        run.close(None)
    # a fresh run traces labels 1, 4, 7, 10 (index 0, 3, 6, 9)
    assert [label for label, t in zip(range(5, 11), traced) if t] == [7, 10]
