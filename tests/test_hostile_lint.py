"""``torchledger lint`` on hostile trees: a FIFO or device among the sources, invalid Python,
absurdly deep expressions. Each file that cannot be linted is named in one line on stderr and
skipped; every other file is still linted and its findings printed; the exit is 2."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from torchledger.lint import LintError, lint_file, lint_paths
from torchledger.cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEAKY = os.path.join(ROOT, "tests", "data", "lint", "leaky_loop.py")
#: leaky_loop.py's two findings (tests/test_lint.py checks them): line 10 and line 15.
LEAKY_RULES = [("TL-LINT-002", 10), ("TL-LINT-001", 15)]


def lint(*args):
    return CliRunner().invoke(cli, ["lint", *args])


def rules(payload: dict) -> list:
    return [(f["rule"], int(f["location"].rsplit(":", 1)[1])) for f in payload["findings"]]


def tree_with(tmp_path, name, make):
    """tmp_path/src holding leaky_loop.py (as a.py) and one hostile file ``name``."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(LEAKY, src / "a.py")
    make(src / name)
    return src


def errors_on_stderr(r) -> list:
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr
    assert all(line.startswith("torchledger: error: ") for line in lines), r.stderr
    return lines


# -- files that are not regular files (item 6) -------------------------------------------------
def test_a_fifo_named_x_py_in_a_tree_is_skipped_not_waited_on(tmp_path):
    src = tree_with(tmp_path, "x.py", os.mkfifo)           # nobody ever writes to it
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "torchledger", "lint", str(src), "--format", "json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "x.py: is a FIFO" in lines[0] and "Traceback" not in out.stderr
    payload = json.loads(out.stdout)
    assert rules(payload) == LEAKY_RULES                   # a.py still linted
    assert payload["files"] == 2 and len(payload["errors"]) == 1


def test_a_device_given_as_a_source_is_one_line():
    r = lint("/dev/zero")
    assert r.exit_code == 2
    lines = errors_on_stderr(r)
    assert len(lines) == 1 and "/dev/zero: is a device" in lines[0]
    with pytest.raises(LintError, match="is a device"):
        lint_file("/dev/zero")


def test_an_oversized_source_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import torchledger.lint.engine as engine
    monkeypatch.setattr(engine, "SOURCE_MAX_BYTES", 100)
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * 20)                         # 120 bytes > 100
    with pytest.raises(LintError, match="larger than 100 bytes"):
        lint_file(str(big))


def test_source_is_decoded_as_python_does(tmp_path):
    # a coding cookie, a BOM and CRLF line endings: the finding's line must still be 3
    p = tmp_path / "latin.py"
    p.write_bytes(b"# -*- coding: latin-1 -*-\r\nimport torch\r\nsd = torch.load('\xe9.pt')\r\n")
    assert [f.location for f in lint_file(str(p))] == [f"{p}:3"]
    q = tmp_path / "bom.py"
    q.write_bytes(b"\xef\xbb\xbfimport torch\nsd = torch.load('a.pt')\n")
    assert [f.location for f in lint_file(str(q))] == [f"{q}:2"]
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"# coding: no-such-codec\nx = 1\n")
    with pytest.raises(LintError, match="cannot decode"):
        lint_file(str(bad))


# -- invalid Python in one file of a tree ------------------------------------------------------
def _broken(path):
    path.write_text("import torch\nfor x in loader\n    pass\n")


@pytest.mark.parametrize("fmt", ["table", "json", "sarif"])
def test_invalid_python_in_one_file_keeps_the_others_findings(tmp_path, fmt):
    src = tree_with(tmp_path, "broken.py", _broken)
    r = lint(str(src), "--format", fmt)
    assert r.exit_code == 2                                # bad input wins over findings (1)
    lines = errors_on_stderr(r)
    assert len(lines) == 1 and "broken.py:2: not valid Python" in lines[0]
    if fmt == "json":
        payload = json.loads(r.stdout)
        assert rules(payload) == LEAKY_RULES and payload["errors"] == [lines[0][len("torchledger: error: "):]]
    elif fmt == "sarif":
        results = json.loads(r.stdout)["runs"][0]["results"]
        assert sorted(x["ruleId"] for x in results) == ["TL-LINT-001", "TL-LINT-002"]
    else:
        assert r.stdout.splitlines()[-1] == ("2 findings (1 error, 1 warning) in 1 file. "
                                             "1 file not linted (errors on stderr).")


def test_lint_paths_raises_or_collects(tmp_path):
    src = tree_with(tmp_path, "broken.py", _broken)
    with pytest.raises(LintError, match="broken.py:2"):
        lint_paths([str(src)])
    errors = []
    found = lint_paths([str(src)], errors=errors)
    assert [(f.rule, int(f.location.rsplit(":", 1)[1])) for f in found] == LEAKY_RULES
    assert len(errors) == 1 and "broken.py:2" in str(errors[0])


# -- expressions nested too deeply for Python (item 7) -----------------------------------------
DEEP = {
    "attributes": "import torch\nx = a" + ".b" * 5000 + "\n",       # 5,000 chained attributes
    "unary-minus": "x = " + "- " * 3000 + "1\n",                    # 3,000 unary minuses
}


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_a_too_deep_expression_skips_that_file_only(tmp_path, kind):
    src = tree_with(tmp_path, "deep.py", lambda p: p.write_text(DEEP[kind]))
    r = lint(str(src), "--format", "json")
    assert r.exit_code == 2
    lines = errors_on_stderr(r)
    assert len(lines) == 1 and "deep.py: an expression is nested too deeply to parse" in lines[0]
    assert "RecursionError" in lines[0]
    assert rules(json.loads(r.stdout)) == LEAKY_RULES     # a.py's findings are all there
    with pytest.raises(LintError, match="nested too deeply"):
        lint_file(str(src / "deep.py"))


def test_a_rule_that_recurses_too_deep_skips_the_file_not_the_rule(monkeypatch):
    # Past the parser's reach a rule may still recurse too deep; the file is then reported,
    # never passed as clean after a partial check (formerly the rule was silently skipped).
    import torchledger.lint.engine as engine

    def deep_rule(src):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(engine, "CHECKS", engine.CHECKS + (deep_rule,))
    with pytest.raises(LintError, match=r"^t\.py: an expression is nested too deeply to check"):
        engine.lint_source("x = 1\n", "t.py")


def test_a_long_sum_is_linted_not_refused():
    # 2,000 terms: a left-nested BinOp chain 2,000 deep, fine for the parser (about 3,000 is
    # its limit here); the rules walk it without recursing once per term.
    from torchledger.lint import lint_source
    src = "import torch\nx = " + " + ".join(["a"] * 2000) + "\nsd = torch.load('a.pt')\n"
    assert [(f.rule, f.location) for f in lint_source(src, "t.py")] == [("TL-LINT-003", "t.py:3")]
