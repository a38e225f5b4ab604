"""Renderers: golden reports of committed scenario records, empty and round-tripped records,
format details (SARIF locations, escaping, CSV columns), file names and atomic writes.

Regenerate the goldens with ``pytest tests/test_render.py --update-goldens`` (and the records
themselves with ``python tests/data/make_records.py``).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import torchledger
from torchledger.record import Finding, StepRecord
from torchledger.render import RENDERERS, format_from_path, render, write_atomic
from torchledger.render.common import EMPTY_SENTENCE, frontier
from torchledger.render.data import CSV_COLUMNS
from torchledger.render.markdown import md_table
from torchledger.render.sarif import SARIF_SCHEMA, artifact_uri, findings_to_sarif
from torchledger.rules import title as rule_title

TESTS = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ["gpt2-tiny", "cruncher-copy", "empty"]
EXTENSION = {"table": "txt", "json": "json", "csv": "csv", "markdown": "md", "sarif": "sarif",
             "html": "html", "trace": "trace.json"}
HUMAN = ["table", "markdown", "html"]


def load(scenario: str) -> StepRecord:
    with open(os.path.join(TESTS, "data", scenario, "record.json"), encoding="utf-8") as fh:
        return StepRecord.from_json(fh.read())


@pytest.fixture
def pinned_version(monkeypatch):
    """Goldens must not change when the package version does."""
    monkeypatch.setattr(torchledger, "__version__", "0.0.0+golden")


# -- golden reports --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(RENDERERS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden(scenario, fmt, update_goldens, pinned_version):
    text = render(load(scenario), None, fmt) + "\n"
    path = os.path.join(TESTS, "golden", f"{scenario}.{EXTENSION[fmt]}")
    if update_goldens:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        return
    assert os.path.exists(path), f"no golden {path}; run pytest --update-goldens"
    with open(path, encoding="utf-8", newline="") as fh:
        expected = fh.read()
    assert text == expected, f"{scenario}.{EXTENSION[fmt]} changed; if intended, run pytest --update-goldens"


def test_renderers_are_deterministic():
    rec = load("gpt2-tiny")
    for fmt in RENDERERS:
        assert render(rec, None, fmt) == render(load("gpt2-tiny"), None, fmt), fmt


# -- empty and round-tripped records ---------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(RENDERERS))
def test_every_renderer_handles_an_empty_record(fmt):
    text = render(StepRecord(), [], fmt)
    assert text
    if fmt in HUMAN:
        assert EMPTY_SENTENCE in text
    elif fmt == "json":
        assert json.loads(text)["modules"] == []
    elif fmt == "csv":
        assert text == ",".join(CSV_COLUMNS)
    elif fmt == "sarif":
        run = json.loads(text)["runs"][0]
        assert run["results"] == []
        notes = run["invocations"][0]["toolExecutionNotifications"]
        assert notes[0]["message"]["text"] == EMPTY_SENTENCE


@pytest.mark.parametrize("fmt", ["markdown", "html", "sarif", "json"])
def test_empty_record_still_shows_findings(fmt):
    f = Finding("TL-TRACE-001", "warning", "the step raised before any op ran")
    assert "TL-TRACE-001" in render(StepRecord(), [f], fmt)


def _traced_record() -> tuple:
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
    return t.record, t.findings()


@pytest.fixture(scope="module")
def traced():
    return _traced_record()


@pytest.mark.parametrize("fmt", sorted(RENDERERS))
def test_a_record_renders_the_same_after_a_json_round_trip(traced, fmt):
    rec, findings = traced
    back = StepRecord.from_json(rec.to_json())
    findings_back = [Finding.from_dict(json.loads(json.dumps(f.to_dict(), default=str))) for f in findings]
    assert render(back, findings_back, fmt) == render(rec, findings, fmt)


@pytest.mark.parametrize("fmt", sorted(RENDERERS))
def test_renderers_tolerate_records_missing_later_fields(fmt):
    rec = load("cruncher-copy")
    d = rec.to_dict()
    for m in d["modules"]:
        for key in ("peak_bytes", "copies", "copy_bytes", "calls", "flops_share"):
            m.pop(key)
    for key in ("memory", "copies", "predictions", "optimizer"):
        d.pop(key)
    d["totals"].pop("attention_flops")
    assert render(StepRecord.from_dict(d), None, fmt)


# -- json, csv -------------------------------------------------------------------------------
def test_json_substitutes_the_findings_and_reads_back():
    rec = load("cruncher-copy")
    f = Finding("TL-X-001", "error", "replaced", module="final", location="a.py:3")
    d = json.loads(render(rec, [f], "json"))
    assert d["schema"] == "torchledger/1" and d["findings"] == [f.to_dict()]
    assert StepRecord.from_dict(d).findings == [f]
    assert json.loads(render(rec, None, "json"))["findings"] == [x.to_dict() for x in rec.findings]


def test_csv_has_one_row_per_module():
    import pandas as pd
    rec = load("gpt2-tiny")
    df = pd.read_csv(io.StringIO(render(rec, None, "csv")), keep_default_na=False)
    assert list(df.columns) == CSV_COLUMNS
    assert len(df) == len(rec.modules)
    assert df["flops_forward"].tolist() == [m["flops_forward"] for m in rec.modules]
    assert df["name"].iloc[0] == ""                     # the root, as named_modules() names it
    shallow = pd.read_csv(io.StringIO(render(rec, None, "csv", depth=1)), keep_default_na=False)
    assert shallow["depth"].max() == 1


# -- sarif -----------------------------------------------------------------------------------
def test_sarif_levels_locations_and_rules():
    findings = [
        Finding("TL-COPY-003", "warning", "copy bought nothing", module="blocks.0", location="src/train.py:42",
                hint="drop it"),
        Finding("TL-MEM-001", "error", "does not fit", module=""),
        Finding("TL-FLOP-001", "info", "3 ops uncounted: a, b. More text."),
        Finding("TL-COPY-003", "warning", "again", location="/abs/dir with space/m.py:7"),
        Finding("TL-LINT-001", "info", "windows", location="C:\\proj\\m.py:3"),
    ]
    log = findings_to_sarif(findings, "1.2.3", source=("model dir/m.py", 5))
    assert log["$schema"] == SARIF_SCHEMA and log["version"] == "2.1.0"
    run = log["runs"][0]
    driver = run["tool"]["driver"]
    assert driver["name"] == "torchledger" and driver["version"] == "1.2.3"
    rules = [r["id"] for r in driver["rules"]]
    assert rules == ["TL-COPY-003", "TL-MEM-001", "TL-FLOP-001", "TL-LINT-001"]
    assert [r["shortDescription"]["text"] for r in driver["rules"]] == [
        rule_title("TL-COPY-003"), rule_title("TL-MEM-001"), rule_title("TL-FLOP-001"),
        "Loss tensor kept across iterations"]
    res = run["results"]
    assert [r["level"] for r in res] == ["warning", "error", "note", "warning", "note"]
    assert [r["ruleIndex"] for r in res] == [0, 1, 2, 0, 3]
    assert all(rules[r["ruleIndex"]] == r["ruleId"] for r in res)
    phys = res[0]["locations"][0]["physicalLocation"]
    assert phys == {"artifactLocation": {"uri": "src/train.py"}, "region": {"startLine": 42}}
    assert res[0]["locations"][0]["logicalLocations"] == [{"fullyQualifiedName": "blocks.0", "kind": "module"}]
    assert res[0]["message"]["text"] == "copy bought nothing. Hint: drop it"
    fallback = {"artifactLocation": {"uri": "model%20dir/m.py"}, "region": {"startLine": 5}}
    assert res[1]["locations"] == [{"physicalLocation": fallback,
                                    "logicalLocations": [{"fullyQualifiedName": "(root)", "kind": "module"}]}]
    assert res[2]["locations"] == [{"physicalLocation": fallback}]
    assert res[3]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == \
        "file:///abs/dir%20with%20space/m.py"
    assert res[4]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "file:///C:/proj/m.py"
    json.dumps(log)                                     # plain JSON all the way down
    # with no file to point at, unlocated findings are tool notifications, not results
    bare = findings_to_sarif(findings, "1.2.3")["runs"][0]
    assert [r["ruleId"] for r in bare["results"]] == ["TL-COPY-003", "TL-COPY-003", "TL-LINT-001"]
    notes = bare["invocations"][0]["toolExecutionNotifications"]
    assert [(n["associatedRule"]["id"], n["level"]) for n in notes] == [("TL-MEM-001", "error"),
                                                                        ("TL-FLOP-001", "note")]
    assert bare["tool"]["driver"]["rules"] == driver["rules"]


def test_sarif_of_a_record_takes_finding_dicts_and_odd_values():
    rec = load("cruncher-copy")
    weird = {"rule": "TL-X", "severity": "info", "message": "m", "measured": {1, 2}, "location": "no-line"}
    log = json.loads(render(rec, [weird], "sarif"))
    result = log["runs"][0]["results"][0]
    assert result["locations"][0]["physicalLocation"] == {"artifactLocation": {"uri": "no-line"},
                                                          "region": {"startLine": 1}}
    assert log["runs"][0]["tool"]["driver"]["rules"][0]["shortDescription"]["text"] == "TL-X"
    assert "invocations" not in log["runs"][0]


def test_sarif_uris_never_climb_out_of_the_checkout(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "sub").mkdir()
    monkeypatch.chdir(repo / "sub")
    assert artifact_uri("../lib/m.py") == "lib/m.py"                # in the work tree: from its root
    assert artifact_uri(str(repo / "sub" / "a b.py")) == "a%20b.py"
    assert artifact_uri("./x/../y.py") == "y.py"
    outside = artifact_uri("../../elsewhere/o.py")
    assert outside == (tmp_path / "elsewhere" / "o.py").as_uri()
    monkeypatch.chdir(tmp_path)                                      # no git tree above
    assert artifact_uri("../far.py") == (tmp_path.parent / "far.py").as_uri()


def test_sarif_audit_record_points_unlocated_findings_at_audit_spec(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("import torch\n\n\ndef audit_spec():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    rec = load("cruncher-copy")
    rec.meta["audit"] = {"file": "m.py", "entry": "audit_spec", "spec_line": 4}   # as audit stores it
    log = json.loads(render(rec, None, "sarif"))
    run = log["runs"][0]
    assert "invocations" not in run
    flop = next(r for r in run["results"] if r["ruleId"] == "TL-FLOP-001")
    assert flop["locations"][0]["physicalLocation"] == {"artifactLocation": {"uri": "m.py"},
                                                        "region": {"startLine": 4}}
    del rec.meta["audit"]["spec_line"]          # a record from before spec_line: line 1, m.py unread
    run = json.loads(render(rec, None, "sarif"))["runs"][0]
    flop = next(r for r in run["results"] if r["ruleId"] == "TL-FLOP-001")
    assert flop["locations"][0]["physicalLocation"]["region"] == {"startLine": 1}


# -- markdown and html details ----------------------------------------------------------------
def test_markdown_escapes_table_cells():
    table = md_table(["a", "b"], [["x|y", "line1\nline2"]])
    assert table.splitlines()[2] == "| x\\|y | line1 line2 |"


def test_markdown_comparisons_and_fallback_predictions():
    rec = load("cruncher-copy")
    md = render(rec, None, "markdown")
    assert "#### Predicted vs measured" in md and "| training FLOPs vs 6ND | 182K (181,760) |" in md
    rec.predictions = {"flops_6nd": 198144}
    md = render(rec, None, "markdown")
    assert "| training FLOPs (flops\\_6nd) | 182K (181,760) | 198K (198,144) | 0.917 |" in md
    rec.predictions = {}
    assert "Predicted vs measured" not in render(rec, None, "markdown")


def test_html_escapes_text_and_loads_nothing():
    rec = load("cruncher-copy")
    rec.modules[2]["name"] = "<script>alert(1)</script>"
    bad = Finding("TL-X", "warning", 'say "<b>hi</b>" & bye', module="<m>", location="a<b>.py:1")
    page = render(rec, [bad], "html", depth=4)
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;hi&lt;/b&gt;" in page and "&amp; bye" in page
    for attr in ("src=", "@import", "url("):
        assert attr not in page
    hrefs = [part.split('"')[0] for part in page.split('href="')[1:]]
    assert hrefs == ["data:,"]
    urls = {w for w in page.replace('"', " ").split() if "://" in w}
    assert urls == {"http://www.w3.org/2000/svg"}      # the SVG namespace: a name, never fetched


def test_frontier_partitions_the_model():
    for scenario in ("gpt2-tiny", "cruncher-copy"):
        rec = load(scenario)
        root = rec.modules[0]
        for depth in range(1, 6):
            rows = [m for m in frontier(rec, depth) if m["name"] != "(no module)"]
            for key in ("flops_forward", "flops_backward", "activation_bytes"):
                assert sum(m[key] for m in rows) == root[key], (scenario, depth, key)


def _chromium():
    for name in ("chromium", "chromium-browser", "chromium-headless-shell"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.parametrize("scenario", ["gpt2-tiny", "empty"])
def test_html_opens_in_headless_chromium_without_console_errors(scenario, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    rec = load(scenario)
    page = tmp_path / "report.html"
    write_atomic(page, render(rec, None, "html"))
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
           "--dump-dom", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The page has no script, so any console message at all (a CSP block, a failed load) is a fault.
    bad = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert bad == [], "\n".join(bad)
    title = "torchledger step report: Transformer on cpu" if scenario == "gpt2-tiny" else "torchledger step report"
    assert f"<title>{title}</title>" in proc.stdout
    assert "<svg" in proc.stdout or scenario == "empty"


# -- dispatch, file names, atomic writes ------------------------------------------------------
def test_render_dispatch_and_unknown_format():
    assert set(RENDERERS) == {"table", "json", "csv", "markdown", "sarif", "html", "trace"}
    rec = load("cruncher-copy")
    assert render(rec, None, "table", depth=1, width=100) == RENDERERS["table"](rec, None, depth=1)
    with pytest.raises(ValueError, match="unknown report format 'xml'.*table, json, csv"):
        render(rec, None, "xml")


def test_report_module_still_exports_render_table():
    from torchledger.render.table import render_table
    from torchledger.render.table import render_table as old
    assert old is render_table


@pytest.mark.parametrize("path, fmt", [
    ("out.json", "json"), ("OUT.JSON", "json"), ("a/b/out.csv", "csv"), ("pr.md", "markdown"),
    ("pr.markdown", "markdown"), ("scan.sarif", "sarif"), ("scan.sarif.json", "sarif"),
    ("step.html", "html"), ("step.htm", "html"), ("report.txt", "table"), ("v1.2.report.md", "markdown"),
    ("step.trace.json", "trace"), ("step.perfetto.json", "trace"),
])
def test_format_from_path(path, fmt):
    assert format_from_path(path) == fmt
    assert format_from_path(os.path.join("dir.json", path)) == fmt


@pytest.mark.parametrize("path", ["report", "report.pdf", "report.json.bak", ".json", "dir.md/"])
def test_format_from_path_rejects_unknown_names(path):
    with pytest.raises(ValueError, match=r"\.json \(json\).*\.sarif \(sarif\).*\.txt \(table\)"):
        format_from_path(path)


def test_write_atomic_writes_text_and_chunks(tmp_path):
    path = tmp_path / "r.md"
    write_atomic(path, "a\nb")
    assert path.read_bytes() == b"a\nb"
    write_atomic(str(path), iter(["x", "y\n", "\u00e9"]))
    assert path.read_text(encoding="utf-8") == "xy\n\u00e9"
    assert os.listdir(tmp_path) == ["r.md"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_write_atomic_keeps_the_old_file_when_the_render_fails(tmp_path):
    path = tmp_path / "step.html"
    path.write_text("old report")
    os.chmod(path, 0o640)

    def failing_render():
        yield "<!DOCTYPE html>\n<html>"
        raise RuntimeError("renderer blew up half way")

    with pytest.raises(RuntimeError, match="half way"):
        write_atomic(path, failing_render())
    assert path.read_text() == "old report"
    assert os.listdir(tmp_path) == ["step.html"]        # no temp file left behind
    write_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_write_atomic_cleans_up_when_the_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "new.csv"

    def no_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "a,b")
    assert os.listdir(tmp_path) == []


def test_importing_the_renderers_loads_neither_torch_nor_pandas():
    code = ("import sys, torchledger.render; "
            "print(sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sarif_rule_descriptions_from_a_rule_table():
    findings = [Finding("TL-A", "info", "copies move 10% (5 copies: clone): fix it"),
                Finding("TL-B", "info", "b"), Finding("TL-C", "info", "c"), Finding("TL-D", "info", "d")]
    rules = {"TL-B": "plain text", "TL-C": ("warning", "from a lint tuple", "doc"), "TL-D": {"title": "dict"}}
    driver = findings_to_sarif(findings, "1", rules=rules, information_uri="https://example.org")["runs"][0][
        "tool"]["driver"]
    # the rules given are listed first, then the others findings name
    assert [r["shortDescription"]["text"] for r in driver["rules"]] == \
        ["plain text", "from a lint tuple", "dict", "TL-A"]          # never a run's message
    assert driver["informationUri"] == "https://example.org"


def test_lint_sarif_uris_outside_the_working_directory_have_no_dotdot(tmp_path, monkeypatch):
    from torchledger.render.sarif import findings_to_sarif as lint_sarif
    (tmp_path / ".git").mkdir()
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    log = lint_sarif([{"rule": "TL-LINT-003", "severity": "warning", "message": "m",
                       "location": "../ltree/ok.py:3"}])
    physical = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
    assert physical == {"artifactLocation": {"uri": "ltree/ok.py"}, "region": {"startLine": 3}}
