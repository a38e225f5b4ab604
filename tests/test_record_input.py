"""Saved records are user input: each malformed one is one named refusal, each valid one renders.

Every case states its outcome: it loads (and renders in every format), or it is refused
with a message naming the field, what was expected and what arrived.
"""
from __future__ import annotations

import copy
import json
import os
import re
import time

import pytest
from click.testing import CliRunner

from torchledger.analyzers.checks import run_checks
from torchledger.cli import cli
from torchledger.record import StepRecord
from torchledger.record.schema import MAX_DEPTH, RecordError, parse_record
from torchledger.render import RENDERERS

DATA = os.path.join(os.path.dirname(__file__), "data", "gpt2-tiny", "record.json")
#: Has findings, copies and an uncounted op to break.
HOSTILE_BASE = os.path.join(os.path.dirname(__file__), "data", "cruncher-copy", "record.json")
COUNT = "expected a whole number from 0 to 2**63-1"

#: What each total of the gpt2-tiny record holds (the shape Record.to_dict() writes).
TOTAL_KINDS = {
    "count": ["params", "matmul_params", "tokens", "flops_causal", "hardware_flops", "activation_bytes",
              "optimizer_state_bytes", "param_bytes", "grad_bytes", "buffer_bytes", "peak_bytes",
              "bytes_read", "bytes_written", "copy_bytes", "trainable_params", "trainable_param_bytes",
              "activation_bytes_peak", "grad_bytes_end", "param_matmul_flops_forward",
              "param_matmul_flops_grad"],
    "counts": ["flops", "attention_flops", "elementwise_flops", "view_ops", "comm_bytes"],
    "text": ["tokens_source", "peak_phase", "peak_module", "mfu_source"],
    "seconds": ["step_seconds", "mfu", "hfu"],
    "rank": ["rank"], "world": ["world_size", "tensor_parallel"], "mesh": ["mesh"],   # torch.distributed
}
#: Refused with: (kind, value) -> message; None: loads.
TOTAL_OUTCOME = {
    ("count", "x"): COUNT, ("count", (1,)): COUNT, ("count", 3): None,
    ("counts", "x"): "expected an object", ("counts", (1,)): "expected an object",
    ("counts", 3): "expected an object",
    ("text", "x"): None, ("text", (1,)): "expected a string or null",
    ("text", 3): "expected a string or null",
    ("seconds", "x"): "expected a number >= 0 or null", ("seconds", (1,)): "expected a number >= 0 or null",
    ("seconds", 3): None,
    # rank 3 of a world of 1 is no rank; a world of 3 with rank 0 and no mesh is; mesh [1] has 1 rank
    ("rank", "x"): COUNT, ("rank", (1,)): COUNT, ("rank", 3): "expected a rank below totals.world_size (1), got 3",
    ("world", "x"): "expected a whole number from 1 to 2**63-1", ("world", (1,)): "expected a whole number from 1",
    ("world", 3): None,
    ("mesh", "x"): "expected a list or null", ("mesh", (1,)): None, ("mesh", 3): "expected a list or null",
}
SECTION_KIND = {"modules": list, "ops": list, "copies": list, "findings": list, "memory": dict,
                "predictions": dict}


def base(path=DATA) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def cases():
    """(name, record dict, expected: None for 'loads', else the refusal's text)."""
    b = base()
    assert sorted(sum(TOTAL_KINDS.values(), [])) == sorted(b["totals"])   # every key has its kind
    out = []
    for key in b:
        d = copy.deepcopy(b)
        del d[key]
        out.append((f"drop {key}", d, "schema: expected 'torchledger/1', got null" if key == "schema" else None))
    for kind, keys in TOTAL_KINDS.items():
        for key in keys:
            d = copy.deepcopy(b)
            del d["totals"][key]
            out.append((f"drop totals.{key}", d, None))
            for wrong in ("x", (1,), 3):
                d = copy.deepcopy(b)
                d["totals"][key] = list(wrong) if isinstance(wrong, tuple) else wrong
                msg = TOTAL_OUTCOME[kind, wrong]
                out.append((f"totals.{key}={wrong!r}", d, msg and f"totals.{key}: {msg}"))
    for section, kind in SECTION_KIND.items():
        for wrong in (5, "x", [5]):
            d = copy.deepcopy(b)
            d[section] = wrong
            if kind is dict:
                msg = f"{section}: expected an object"
            else:
                msg = f"{section}[0]: expected an object, got 5" if wrong == [5] else f"{section}: expected a list"
            out.append((f"{section}={wrong!r}", d, msg))
    d = copy.deepcopy(b)
    d["totals"]["flops"] = {}
    out.append(("empty totals.flops", d, None))
    return out


CASES = cases()


@pytest.mark.parametrize("name, data, refused", CASES, ids=[c[0] for c in CASES])
def test_each_mutation_loads_and_renders_or_is_refused_by_name(name, data, refused):
    if refused is not None:
        with pytest.raises(RecordError) as e:
            StepRecord.from_dict(data)
        assert refused in str(e.value) and "\n" not in str(e.value)
        return
    rec = StepRecord.from_dict(data)
    findings = run_checks([rec])
    for fmt, render in RENDERERS.items():
        text = render(rec, findings)
        if fmt in ("json", "sarif"):
            json.loads(text, parse_constant=pytest.fail)


def test_the_outcomes_are_not_all_the_same():
    """The table above is a real split: both loads and refusals of each total kind occur."""
    assert sum(c[2] is None for c in CASES) > 40 and sum(c[2] is not None for c in CASES) > 40


# -- the CLI: one line, exit 2, the field named ----------------------------------------------
def report(path, *args):
    return CliRunner().invoke(cli, ["report", str(path), *args])


def one_line(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output, err
    for n in needles:
        assert n in err, err
    return err


def _edit(fn) -> str:
    d = base(HOSTILE_BASE)
    fn(d)
    return json.dumps(d, ensure_ascii=False)


def _set(path, value):
    def fn(d):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[last] = value
    return fn


def _raw(path, literal: str) -> str:
    """The record with the field at ``path`` written as ``literal`` (JSON text json.dumps won't make)."""
    text = _edit(_set(path, "@@SENTINEL@@"))
    assert text.count('"@@SENTINEL@@"') == 1
    return text.replace('"@@SENTINEL@@"', literal)


HOSTILE = [
    # (name, record text, field, what was expected, what arrived)
    ("NaN", _raw(["totals", "params"], "NaN"), "totals.params", "finite number", "got NaN"),
    ("Infinity", _raw(["totals", "step_seconds"], "Infinity"),
     "totals.step_seconds", "finite number", "got Infinity"),
    ("-Infinity in a finding", _raw(["findings", 0, "measured"], "-Infinity"),
     "findings[0].measured", "finite number", "got -Infinity"),
    ("1e400 overflows to inf", _raw(["totals", "mfu"], "1e400"), "totals.mfu", "finite number", "got 1e400"),
    ("4000-digit int", _raw(["totals", "params"], "9" * 4000),
     "totals.params", "within int64", "4000-digit number"),
    ("5000-digit int (past int->str)", _raw(["totals", "tokens"], "7" * 5000),
     "totals.tokens", "within int64", "5000-digit number"),
    ("2**63 in a module", _edit(lambda d: d["modules"][1].update(params=2**63)),
     "modules[1].params", "within int64", str(2**63)),
    ("negative count", _edit(_set(["totals", "flops", "total"], -5)), "totals.flops.total", COUNT, "got -5"),
    ("null count", _edit(_set(["totals", "activation_bytes"], None)), "totals.activation_bytes", COUNT,
     "got null"),
    ("float count", _edit(_set(["totals", "peak_bytes"], 1.5)), "totals.peak_bytes", COUNT, "got 1.5"),
    ("bool count", _edit(_set(["totals", "params"], True)), "totals.params", COUNT, "got true"),
    ("lone surrogate value", _raw(["meta", "model"], '"\\ud800GPT"'),
     "meta.model", "a string that UTF-8 can encode", "lone surrogate '\\ud800'"),
    ("lone surrogate key", _edit(lambda d: None).replace('"peak_breakdown"', '"\\udfffpb"'),
     "memory: expected a key that UTF-8 can encode", "", "lone surrogate '\\udfff'"),
    ("1,100 nested brackets", _raw(["meta", "x"], "[" * 1100 + "]" * 1100),
     "nested 1102 levels deep", f"at most {MAX_DEPTH}", ""),
    ("nesting in a finding", _edit(lambda d: d["findings"][0].update(measured=json.loads("[" * 40 + "]" * 40))),
     "nested 43 levels deep", f"at most {MAX_DEPTH}", ""),
    ("module depth huge", _edit(lambda d: d["modules"][1].update(depth=10**9)),
     "modules[1].depth", "from 0 to 1,000", "got 1000000000"),
    ("severity", _edit(lambda d: d["findings"][0].update(severity="fatal")),
     "findings[0].severity", "one of error, warning, info", "'fatal'"),
    ("finding without rule", _edit(lambda d: d["findings"][0].pop("rule")),
     "findings[0].rule", "a string", "the key is missing"),
    ("uncounted op without count", _edit(lambda d: d["uncounted_ops"][0].pop("count")),
     "uncounted_ops[0].count", COUNT, "missing"),
    ("comparison quantity a number", _edit(lambda d: d["predictions"]["comparisons"][0].update(quantity=7)),
     "predictions.comparisons[0].quantity", "a string", "got 7"),
    ("prediction a string", _edit(_set(["predictions", "flops_6nd"], "lots")),
     "predictions.flops_6nd", "a number, null, an object or a list", "'lots'"),
    ("timeline bytes a string", _edit(lambda d: d["memory"]["timeline"][0].update(parameters="x")),
     "memory.timeline[0].parameters", COUNT, "'x'"),
    ("timeline category 'phase'", _edit(lambda d: d["memory"]["categories"].append("phase")),
     "memory.categories", "byte counts", "'phase'"),
    ("allocator without summary", _edit(_set(["memory", "allocator"], {"available": True})),
     "memory.allocator.summary", "allocator summary", "nothing"),
    ("attention kernels a string", _edit(_set(["meta", "attention_kernels"], "flash")),
     "meta.attention_kernels", "a list or null", "'flash'"),
    ("warning an object", _edit(lambda d: d["warnings"].append({"a": 1})),
     "warnings[0]", "a string", "an object"),
    ("a list, not an object", "[1, 2]", "expected a JSON object", "torchledger/1", "a list of 2"),
    ("other schema", _edit(_set(["schema"], "torchledger/2")), "schema", "'torchledger/1'", "'torchledger/2'"),
    ("not JSON", '{"schema": "torchledger/1", ', "not valid JSON", "line 1", "column"),
]


@pytest.mark.parametrize("name, text, field, expected, got", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_record_is_one_line_naming_field_expected_and_arrived(tmp_path, name, text, field, expected, got):
    path = tmp_path / "r.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for fmt in ("table", "sarif"):
        one_line(report(path, "--format", fmt), str(path), field, expected, got)


def test_hostile_edits_really_change_the_record():
    """Each text replacement above found its target (else the test would pass on a good record)."""
    good = _edit(lambda d: None)
    for name, text, *_ in HOSTILE:
        assert text != good, name


def test_invalid_utf8_bytes():
    with pytest.raises(RecordError, match=r"not UTF-8 text \(byte 15\)"):
        parse_record(b'{"schema": "tor\xff"}')


def test_old_record_without_later_fields_loads_and_renders(tmp_path):
    """Fields added later (totals.tokens_source, modules[].peak_bytes, memory, ...) may be absent."""
    d = base()
    d["totals"] = {k: d["totals"][k] for k in ("params", "tokens", "flops", "activation_bytes",
                                                "optimizer_state_bytes", "param_bytes", "grad_bytes",
                                                "peak_bytes", "step_seconds", "mfu")}
    d["modules"] = [{k: m[k] for k in ("name", "type", "params", "flops_forward", "flops_backward",
                                       "activation_bytes")} for m in d["modules"]]
    for key in ("memory", "copies", "optimizer", "ops", "conventions"):
        d.pop(key)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    for fmt in RENDERERS:
        r = report(path, "--format", fmt)
        assert r.exit_code == 0, r.output
    table = report(path).stdout
    assert "tokens: 32; FLOPs/token " in table and "total 26M (25,952,256)" in table


# -- the files themselves ------------------------------------------------------------------
def test_fifo_device_and_directory_are_refused_promptly(tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    for path, what in ((fifo, "is a FIFO"), ("/dev/zero", "is a device"), (tmp_path, "is a directory")):
        start = time.monotonic()
        one_line(report(path), str(path), what, "torchledger audit")
        assert time.monotonic() - start < 5


def test_missing_record(tmp_path):
    one_line(report(tmp_path / "none.json"), "no such file", "torchledger audit FILE.py")


# -- --baseline: a gate against bad numbers must not pass ---------------------------------------
MODEL = '''
import torch, torchledger
def audit_spec():
    return torchledger.AuditSpec(torch.nn.Linear(4, 2), torch.randn(3, 4))
'''


@pytest.mark.parametrize("field, literal, needles", [
    (["totals", "flops", "total"], "NaN", ["totals.flops.total", "finite number", "got NaN"]),
    (["totals", "peak_bytes"], "Infinity", ["totals.peak_bytes", "finite number", "got Infinity"]),
    (["totals", "params"], "-4128", ["totals.params", COUNT, "got -4128"]),
    (["totals", "activation_bytes"], "1e999", ["totals.activation_bytes", "finite number", "got 1e999"]),
    (["totals", "flops", "total"], "0", ["totals.flops.total: expected a positive number", "got 0"]),
    (["totals", "params"], "0", ["totals.params: expected a positive number", "got 0"]),
    (["totals", "peak_bytes"], "0", ["totals.peak_bytes: expected a positive number", "got 0"]),
])
def test_baseline_with_bad_totals_is_bad_input_not_a_passing_gate(tmp_path, field, literal, needles):
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    base_path = tmp_path / "base.json"
    base_path.write_text(_raw(field, literal))
    out = tmp_path / "out.json"
    r = CliRunner().invoke(cli, ["audit", str(model), "--steps", "1", "--baseline", str(base_path),
                                 "--output", str(out)])
    one_line(r, f"--baseline {base_path}", *needles)
    assert not out.exists()


def test_growth_from_a_zero_baseline_is_growth():
    """activation_bytes 0 in the baseline (a step that saved nothing for backward) and 5,184
    now: the gate fails; before, ``if before`` skipped the comparison and the gate passed."""
    from torchledger.settings import compare_baseline
    now = StepRecord.from_dict(base(HOSTILE_BASE))
    b = base(HOSTILE_BASE)
    b["totals"]["activation_bytes"] = 0
    findings, _ = compare_baseline(now, StepRecord.from_dict(b), 0.01)
    assert [f.message for f in findings] == [
        "activation bytes grew from nothing over the baseline (0 -> 5,184; tolerance 1%)"]
    assert compare_baseline(now, now, 0.01)[0] == []


@pytest.mark.parametrize("text, outcome", [
    ('{"a": 9223372036854775807}', None),                       # 2**63-1: int64's largest
    ('{"a": 9223372036854775808}', "a: expected a whole number within int64"),
    ('{"a": -9223372036854775808}', None),
    ('{"a": 1e308}', None),
    ('{"a": 1e309}', "a: expected a finite number"),           # float("1e309") is inf
    ('{"a": "\ud800"}', "a: expected a string that UTF-8 can encode"),   # a raw surrogate in a str
    ('{"a": "\\\\ud800"}', None),                               # an escaped backslash, then text
    ('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', None),  # brackets in a string do not nest
])
def test_parse_bounds(text, outcome):
    if outcome is None:
        assert isinstance(parse_record(text), dict)
    else:
        with pytest.raises(RecordError, match=re.escape(outcome)):
            parse_record(text)
