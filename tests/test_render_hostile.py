"""Outputs that another program opens: CSV in a spreadsheet, SARIF in code scanning.

Text from a record (module names, finding locations) must not become a spreadsheet formula
or an invalid SARIF location, and rendering a record never opens a path the record names.
"""
from __future__ import annotations

import csv
import io
import json
import os
import threading

import pytest
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.record import Finding, StepRecord
from torchledger.render import render
from torchledger.render.data import csv_cell

DATA = os.path.join(os.path.dirname(__file__), "data", "cruncher-copy", "record.json")


def load() -> dict:
    with open(DATA, encoding="utf-8") as fh:
        return json.load(fh)


# -- CSV: formula injection (OWASP) -----------------------------------------------------------
FORMULAS = ['=HYPERLINK("http://evil","x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\tx", "\rx"]


def test_csv_cells_that_start_like_a_formula_are_text():
    d = load()
    for mod, name in zip(d["modules"][1:], FORMULAS):
        mod["name"] = name
    d["modules"][1]["type"] = "=cmd|' /C calc'!A0"
    text = render(StepRecord.from_dict(d), None, "csv", depth=None)
    rows = list(csv.DictReader(io.StringIO(text)))
    names = [r["name"] for r in rows[1:1 + len(FORMULAS)]]
    assert names == ["'" + n for n in FORMULAS[:-1]] + ["\\rx"]    # a CR is shown as \r, not a line break
    assert rows[1]["type"] == "'=cmd|' /C calc'!A0"
    assert rows[0]["name"] == "" and rows[0]["params"] == "4128"      # the root: numbers stay numbers
    for r in rows:                                  # no cell at all starts like a formula
        for key, cell in r.items():
            assert not cell.startswith(("=", "+", "@", "\t", "\r")), (key, cell)


@pytest.mark.parametrize("value, cell", [
    ("blocks.0", "blocks.0"), ("", ""), ("a=b", "a=b"), (" =x", " =x"),
    ("=1+1", "'=1+1"), ("-1", "'-1"),               # a string "-1" is text, not a number
    ("\tx", "'\tx"), ("\rx", "\\rx"), ("a\rb", "a\\rb"),
    (-5, -5), (-0.5, -0.5), (0, 0), (3.25, 3.25),   # real numbers, negative ones too, stay numbers
])
def test_csv_cell(value, cell):
    assert csv_cell(value) == cell and type(csv_cell(value)) is type(cell)


def test_csv_of_the_committed_records_is_unchanged_by_the_guard():
    """No committed module name starts like a formula, so the golden CSVs stay byte-identical."""
    for scenario in ("gpt2-tiny", "cruncher-copy"):
        with open(os.path.join(os.path.dirname(__file__), "golden", f"{scenario}.csv"), encoding="utf-8") as fh:
            assert "'" not in fh.read()


# -- SARIF: locations --------------------------------------------------------------------------
def _sarif(locations, record=None):
    rec = record or StepRecord.from_dict(load())
    findings = [Finding(f"TL-X-{i:03d}", "warning", "m", location=loc) for i, loc in enumerate(locations)]
    return json.loads(render(rec, findings, "sarif"))["runs"][0]


@pytest.mark.parametrize("location, uri, line", [
    ("src/a.py:42", "src/a.py", 42),
    ("src/a.py:0", "src/a.py", 1),                              # lines start at 1
    ("src/a.py:99999999999999", "src/a.py", 1),                 # past int32: line 1 of the file
    ("src/a.py:" + "9" * 5000, "src/a.py", 1),                  # past Python's int-from-text limit
    ("src/a.py:2147483647", "src/a.py", 2**31 - 1),
    ("src/a.py:2147483648", "src/a.py", 1),
    ("src/a.py", "src/a.py", 1),
])
def test_sarif_start_line_is_a_positive_int32(location, uri, line):
    result = _sarif([location])["results"][0]
    phys = result["locations"][0]["physicalLocation"]
    assert phys["artifactLocation"]["uri"] == uri and phys["region"]["startLine"] == line


def test_sarif_bad_column_is_dropped_not_zero():
    phys = _sarif(["a.py:3:0"])["results"][0]["locations"][0]["physicalLocation"]
    assert phys["region"] == {"startLine": 3}
    phys = _sarif(["a.py:3:7"])["results"][0]["locations"][0]["physicalLocation"]
    assert phys["region"] == {"startLine": 3, "startColumn": 7}


@pytest.mark.parametrize("blank", ["   ", "\t", "./", "./:3"])
def test_sarif_blank_location_gives_no_empty_uri(blank):
    """A finding whose location is blank points where an unlocated one does: the audited file
    (here meta.audit names one), else it is a tool notification: never uri ''."""
    d = load()
    d["meta"]["audit"] = {"file": "no-such-model.py", "entry": "audit_spec"}
    run = _sarif([blank], StepRecord.from_dict(d))
    phys = run["results"][0]["locations"][0]["physicalLocation"]
    assert phys == {"artifactLocation": {"uri": "no-such-model.py"}, "region": {"startLine": 1}}
    run = _sarif([blank], StepRecord.from_dict(load()))            # no model file: a notification
    assert run["results"] == []
    assert [n["associatedRule"]["id"] for n in run["invocations"][0]["toolExecutionNotifications"]] == ["TL-X-000"]
    text = json.dumps(run)
    assert '"uri": ""' not in text


# -- SARIF never opens a path the record names ---------------------------------------------------
@pytest.mark.parametrize("named", ["fifo", "/dev/zero", "model"])
def test_report_sarif_never_opens_the_model_file_a_record_names(tmp_path, named):
    """meta.audit.file naming a FIFO hung `report --format sarif` (it read the file for the
    audit_spec line) and /dev/zero exhausted memory. The line now comes from the record."""
    if named == "fifo":
        target = tmp_path / "m.py"
        os.mkfifo(target)
    elif named == "model":                          # a real file with the def on line 4:
        target = tmp_path / "m.py"                  # still unread, the record's line 9 wins
        target.write_text("import torch\n\n\ndef audit_spec():\n    pass\n")
    else:
        target = named
    d = load()
    d["meta"]["audit"] = {"file": str(target), "entry": "audit_spec", "spec_line": 9}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    result = {}

    def go():
        result["r"] = CliRunner().invoke(cli, ["report", str(path), "--format", "sarif"])
    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(20)
    if named == "fifo" and worker.is_alive():       # unblock the reader so the test process can end
        with open(os.open(target, os.O_WRONLY | os.O_NONBLOCK), "w"):
            pass
    assert not worker.is_alive(), "report --format sarif hung on the path named in the record"
    r = result["r"]
    assert r.exit_code == 0, r.output
    run = json.loads(r.stdout)["runs"][0]
    flop = next(res for res in run["results"] if res["ruleId"] == "TL-FLOP-001")
    assert flop["locations"][0]["physicalLocation"]["region"] == {"startLine": 9}


def test_audit_stores_the_audit_spec_line(tmp_path):
    model = tmp_path / "m.py"
    model.write_text("import torch\nimport torchledger\n\n\n\ndef audit_spec():\n"
                     "    return torchledger.AuditSpec(torch.nn.Linear(4, 2), torch.randn(3, 4))\n")
    r = CliRunner().invoke(cli, ["audit", str(model), "--steps", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["meta"]["audit"]["spec_line"] == 6       # "def audit_spec():" is line 6


def test_spec_location_of_a_fifo_is_line_one_without_hanging(tmp_path):
    from torchledger.render.sarif import spec_location
    fifo = tmp_path / "m.py"
    os.mkfifo(fifo)
    assert spec_location(str(fifo)) == (str(fifo), 1)
    assert spec_location("/dev/zero") == ("/dev/zero", 1)
