"""``--format trace``: Trace Event JSON for ui.perfetto.dev and chrome://tracing.

The traces are checked against a schema written from the Trace Event Format document
(docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): required keys per
``ph``, numeric non-negative ``ts``/``dur``, integer ``pid``/``tid``, balanced ``B``/``E``, and
complete events (``X``) properly nested on each thread (Perfetto drops slices that overlap
without nesting). Then: determinism, empty records, and hand-checked content of tiny steps.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import torchledger
from torchledger.cli import cli
from torchledger.record import Finding, StepRecord
from torchledger.record.jsonio import RecordError
from torchledger.render import format_from_path, render
from torchledger.render.trace_events import SYNTHETIC_CLOCK, render_trace

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# -- a schema from the Trace Event Format spec ------------------------------------------------
_PHASES = set("BEXiIC") | {"M", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D", "R", "c"}
_METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_trace(doc) -> list:
    """Problems of a Trace Event JSON object (the "JSON Object Format"), [] when valid."""
    errs = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["top level: expected an object with a traceEvents list"]
    if "displayTimeUnit" in doc and doc["displayTimeUnit"] not in ("ms", "ns"):
        errs.append("displayTimeUnit: expected 'ms' or 'ns'")
    if "otherData" in doc and not isinstance(doc["otherData"], dict):
        errs.append("otherData: expected an object")
    open_b: dict = {}
    slices: dict = {}
    for i, e in enumerate(doc["traceEvents"]):
        where = f"event {i} ({e.get('ph') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            errs.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in _PHASES:
            errs.append(f"{where}: unknown ph")
            continue
        for key in ("pid", "tid"):
            if not (isinstance(e.get(key), int) and not isinstance(e.get(key), bool)):
                errs.append(f"{where}: {key} must be an integer")
        if not isinstance(e.get("name"), str):
            errs.append(f"{where}: name must be a string")
        if "args" in e and not isinstance(e["args"], dict):
            errs.append(f"{where}: args must be an object")
        if ph == "M":
            if e.get("name") not in _METADATA:
                errs.append(f"{where}: unknown metadata name {e.get('name')!r}")
            elif not isinstance(e.get("args"), dict) or not e["args"]:
                errs.append(f"{where}: metadata needs args")
            continue
        if not _num(e.get("ts")) or e["ts"] < 0:
            errs.append(f"{where}: ts must be a number >= 0")
            continue
        key = (e.get("pid"), e.get("tid"))
        if ph == "X":
            if not _num(e.get("dur")) or e["dur"] < 0:
                errs.append(f"{where}: dur must be a number >= 0")
                continue
            slices.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"], i))
        elif ph == "B":
            open_b.setdefault(key, []).append(e["ts"])
        elif ph == "E":
            if not open_b.get(key):
                errs.append(f"{where}: E without a B on {key}")
            elif open_b[key].pop() > e["ts"]:
                errs.append(f"{where}: E before its B")
        elif ph in "iI":
            if e.get("s", "t") not in ("g", "p", "t"):
                errs.append(f"{where}: instant scope must be g, p or t")
        elif ph == "C":
            if not isinstance(e.get("args"), dict) or not all(_num(v) for v in e["args"].values()):
                errs.append(f"{where}: a counter's args must map series names to numbers")
    errs += [f"B without an E on {k}" for k, v in open_b.items() if v]
    for key, spans in slices.items():       # X events on one thread nest or follow each other
        stack: list = []
        for start, end, i in sorted(spans, key=lambda s: (s[0], -(s[1] - s[0]), s[2])):
            while stack and start >= stack[-1][1]:
                stack.pop()
            if stack and end > stack[-1][1]:
                errs.append(f"event {i}: slice [{start}, {end}) overlaps [{stack[-1][0]}, {stack[-1][1]}) "
                            f"on {key} without nesting")
            stack.append((start, end))
    return errs


def test_the_schema_catches_what_perfetto_rejects():
    ok = {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 4}
    assert check_trace({"traceEvents": [ok, {**ok, "ts": 1, "dur": 2}]}) == []     # nested
    assert check_trace({"traceEvents": [ok, {**ok, "ts": 4, "dur": 2}]}) == []     # touching
    assert "without nesting" in check_trace({"traceEvents": [ok, {**ok, "ts": 2, "dur": 4}]})[0]
    assert check_trace({"traceEvents": [ok, {**ok, "ts": 2, "dur": 4, "tid": 2}]}) == []   # other thread
    assert "dur" in check_trace({"traceEvents": [{**ok, "dur": -1}]})[0]
    assert "tid" in check_trace({"traceEvents": [{**ok, "tid": "1"}]})[0]
    assert "B without an E" in check_trace({"traceEvents": [{**ok, "ph": "B"}]})[0]
    assert "E without a B" in check_trace({"traceEvents": [{**ok, "ph": "E"}]})[0]
    assert "counter" in check_trace({"traceEvents": [{**ok, "ph": "C", "args": {"a": "x"}}]})[0]
    assert "top level" in check_trace([ok])[0]


def _load(text: str) -> dict:
    doc = json.loads(text)
    assert check_trace(doc) == []
    return doc


def _events(doc, ph, cat=None) -> list:
    return [e for e in doc["traceEvents"] if e["ph"] == ph and (cat is None or e.get("cat") == cat)]


# -- tiny steps checked by hand ------------------------------------------------------------------
@pytest.fixture(scope="module")
def linear_step():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8)                   # made outside: inside, randn is an op of phase "other"
    with torchledger.trace(model, optimizer=opt, tokens=2) as t:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return t.record


def test_linear_step_forward_slice_holds_the_addmm_with_its_flops(linear_step):
    doc = _load(render_trace(linear_step))
    phases = {e["name"]: e for e in _events(doc, "X", "phase")}
    assert list(phases) == ["forward", "backward", "optimizer"]
    fwd = phases["forward"]
    addmm = [e for e in _events(doc, "X", "op") if e["name"] == "aten.addmm.default"]
    assert len(addmm) == 1
    op = addmm[0]
    assert fwd["ts"] <= op["ts"] and op["ts"] + op["dur"] <= fwd["ts"] + fwd["dur"]
    assert op["args"]["flops"] == 2 * 2 * 8 * 4            # 2 x rows x in x out = 128
    assert fwd["args"]["flops"] == 128
    root = [e for e in _events(doc, "X", "module") if e["ts"] <= op["ts"] < e["ts"] + e["dur"]]
    assert [(e["name"], e["args"]["type"]) for e in root] == [("(root)", "Linear")]
    # the weight gradient x^T @ dy: 2 x 2 x 8 x 4 = 128 in backward (the input needs no grad)
    assert phases["backward"]["args"]["flops"] == 128
    # every op is on the timeline once: the op slices add up to meta.ops, 1 op = 1 us
    ops = _events(doc, "X", "op")
    assert sum(e["dur"] for e in ops) == sum(e["args"]["count"] for e in ops) == linear_step.meta["ops"]
    assert sum(e["dur"] for e in phases.values()) == linear_step.meta["ops"]
    assert doc["otherData"]["clock"] == SYNTHETIC_CLOCK
    assert "synthetic" in _events(doc, "M")[0]["args"]["name"]


def test_memory_counters_follow_the_timeline(linear_step):
    doc = _load(render_trace(linear_step))
    counters = _events(doc, "C")
    timeline = linear_step.memory["timeline"]
    assert [e["ts"] for e in counters] == [r["op_index"] for r in timeline]
    peak = [e for e in counters if e["ts"] == linear_step.memory["peak_op_index"]][0]
    assert sum(peak["args"].values()) == linear_step.totals["peak_bytes"]   # categories add up
    # parameters: (8 x 4 + 4) x 4 B = 144 from the first op on
    assert all(e["args"]["parameters"] == 144 for e in counters)


def test_module_slices_nest_in_a_transformer():
    from torchledger.models import build_model, example_inputs, get_config
    torch.manual_seed(0)
    cfg = get_config("gpt2-tiny").replace(n_layers=1)
    model = build_model(cfg)
    inputs = example_inputs(cfg, batch=1, seq_len=8)
    opt = torch.optim.AdamW(model.parameters())
    with torchledger.trace(model, optimizer=opt, tokens=8) as t:
        model(**inputs).backward()          # targets given: the model returns the loss
        opt.step()
    rec = t.record
    doc = _load(render_trace(rec))
    mods = _events(doc, "X", "module")
    fwd = [e for e in _events(doc, "X", "phase") if e["name"] == "forward"][0]
    names = {e["name"] for e in mods if fwd["ts"] <= e["ts"] < fwd["ts"] + fwd["dur"]}
    assert {"(root)", "blocks", "blocks.0", "blocks.0.attn"} <= names
    # a child slice lies inside its parent's
    child = [e for e in mods if e["name"] == "blocks.0.attn"][0]
    parent = [e for e in mods if e["name"] == "blocks.0" and e["ts"] <= child["ts"] < e["ts"] + e["dur"]][0]
    assert child["ts"] + child["dur"] <= parent["ts"] + parent["dur"]
    # the matmul-class FLOPs on the timeline are the record's, phase by phase
    for ph in _events(doc, "X", "phase"):
        if ph["name"] in ("forward", "backward", "optimizer"):
            assert sum(p["args"]["flops"] for p in _events(doc, "X", "phase") if p["name"] == ph["name"]) \
                == rec.totals["flops"][ph["name"]]
    assert sum(s["end"] - s["start"] for s in rec.memory["segments"]) == rec.meta["ops"]


def test_copies_sit_on_their_op_and_findings_on_their_module():
    class Permuter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).t().contiguous().sum()

    torch.manual_seed(0)
    model = Permuter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, optimizer=opt, tokens=4) as t:
        model(torch.randn(4, 8)).backward()
        opt.step()
    rec = t.record
    doc = _load(render_trace(rec, [Finding("TL-TEST-001", "warning", "made up", module="lin")]))
    copies = _events(doc, "i", "copy")
    assert len(copies) == len(rec.copies) >= 1
    c = copies[0]
    assert c["args"]["reason"] == "contiguous of non-contiguous"
    assert c["args"]["bytes"] == 4 * 8 * 4                     # 4 x 8 float32 = 128 B
    assert c["args"]["location"].endswith(f"test_trace_events.py:{Permuter.forward.__code__.co_firstlineno + 1}")
    clone = [e for e in _events(doc, "X", "op") if e["name"] == "aten.clone.default"
             and e["args"]["phase"] == "forward"]
    assert [e["ts"] for e in clone] == [c["ts"]]
    finding = _events(doc, "i", "finding")
    lin = [e for e in _events(doc, "X", "module") if e["name"] == "lin"]
    assert [f["name"] for f in finding] == ["warning TL-TEST-001"]
    assert finding[0]["ts"] == min(e["ts"] for e in lin)       # the module's first (forward) slice


# -- determinism and empty input ---------------------------------------------------------------
def test_byte_for_byte_deterministic(linear_step):
    text = render_trace(linear_step)
    assert render_trace(linear_step) == text
    back = StepRecord.from_json(linear_step.to_json())
    assert render_trace(back) == text
    assert json.loads(text) == json.loads(json.dumps(linear_step.to_trace()))
    assert render(linear_step, None, "trace") == text


def test_an_empty_record_renders_a_valid_trace():
    doc = _load(render_trace(StepRecord()))
    assert {e["ph"] for e in doc["traceEvents"]} == {"M"}
    assert "no ops were traced" in doc["otherData"]["layout"]
    doc = _load(render_trace(StepRecord(), [Finding("TL-TRACE-001", "warning", "raised before any op")]))
    assert [e["name"] for e in _events(doc, "i")] == ["warning TL-TRACE-001"]


@pytest.mark.parametrize("scenario", ["gpt2-tiny", "cruncher-copy", "empty"])
def test_records_saved_before_segments_draw_phases_from_the_timeline(scenario):
    with open(os.path.join(TESTS, "data", scenario, "record.json"), encoding="utf-8") as fh:
        d = json.load(fh)
    full = _load(render_trace(StepRecord.from_dict(d)))
    d["memory"].pop("segments", None)           # as saved before the tracer kept op order
    rec = StepRecord.from_dict(d)
    doc = _load(render_trace(rec))
    assert "no memory.segments" in doc["otherData"]["layout"] or scenario == "empty"
    assert _events(doc, "X", "op") == _events(doc, "X", "module") == []
    phases = _events(doc, "X", "phase")
    # the sampled boundaries are within one sample of the exact ones
    exact = _events(full, "X", "phase")
    assert [p["name"] for p in phases] == [p["name"] for p in exact]
    step = max(1, -(-rec.meta.get("ops", 0) // 400))
    assert all(abs(a["ts"] - b["ts"]) <= step for a, b in zip(phases, exact))
    assert [p["name"] for p in phases] == ([] if scenario == "empty" else rec.meta["phases"])
    if phases:      # they tile the step: each starts where the last ended, the last at the end row
        assert phases[0]["ts"] == 0
        assert all(a["ts"] + a["dur"] == b["ts"] for a, b in zip(phases, phases[1:]))
        assert phases[-1]["ts"] + phases[-1]["dur"] == rec.memory["timeline"][-1]["op_index"]
    assert len(_events(doc, "i", "copy")) == len(rec.copies)


def test_segments_are_validated_and_optional():
    rec = StepRecord()
    d = rec.to_dict()
    d["memory"] = {"segments": [{"start": 3, "end": 1, "phase": "forward", "module": None, "ops": []}]}
    with pytest.raises(RecordError, match=r"memory\.segments\[0\]\.end.*>= start"):
        StepRecord.from_dict(d)
    d["memory"] = {"segments": [{"start": 0, "end": 1, "phase": "forward", "module": None, "ops": [["mm", 1]]}]}
    with pytest.raises(RecordError, match="op name, count, FLOPs"):
        StepRecord.from_dict(d)


# -- file names and the CLI ------------------------------------------------------------------------
@pytest.mark.parametrize("path, fmt", [("step.trace.json", "trace"), ("a/Step.Perfetto.JSON", "trace"),
                                       ("step.json", "json"), ("scan.sarif.json", "sarif")])
def test_trace_extension_does_not_take_json(path, fmt):
    assert format_from_path(path) == fmt


def test_report_writes_a_trace_from_the_output_name(tmp_path):
    out = tmp_path / "step.trace.json"
    res = CliRunner().invoke(cli, ["report", os.path.join(TESTS, "data", "gpt2-tiny", "record.json"),
                                    "--output", str(out)])
    assert res.exit_code == 0, res.output
    doc = _load(out.read_text())
    assert doc["otherData"]["model"] == "Transformer"
    res = CliRunner().invoke(cli, ["report", os.path.join(TESTS, "data", "gpt2-tiny", "record.json"),
                                    "--format", "trace"])
    assert res.exit_code == 0 and json.loads(res.stdout) == doc


def test_audit_format_trace(tmp_path):
    out = tmp_path / "cruncher.trace.json"
    res = CliRunner().invoke(cli, ["audit", os.path.join(ROOT, "examples", "cruncher.py"), "--steps", "1",
                                    "--output", str(out), "--fail-on", "never"])
    assert res.exit_code == 0, res.output
    doc = _load(out.read_text())
    # Cruncher: 4 x Linear(128, 128) + Linear(128, 1) on 32 rows: 2*32*128*(128*4 + 1) = 4,202,496
    fwd = [e for e in _events(doc, "X", "phase") if e["name"] == "forward"]
    assert sum(e["args"]["flops"] for e in fwd) == 2 * 32 * 128 * (128 * 4 + 1)
    assert {"layers.0", "layers.3", "final"} <= {e["name"] for e in _events(doc, "X", "module")}
