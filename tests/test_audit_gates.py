"""CI gates people can keep on: per-rule suppression, case-insensitive --device, --output into
a missing folder, a hint for MoE layers on fake tensors, TL-LINT-003's severity by torch's
default, and the autocast compute dtype in the report."""
from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from torchledger.lint import lint_source
from torchledger.cli import cli
from torchledger.settings import known_rules


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.output, err
    for n in needles:
        assert n in err, err
    return err


#: a torch.load without weights_only: one TL-LINT-003 (info) in every audit of this file
LOADS = """
    import torch, torchledger
    def audit_spec():
        if False:
            torch.load("ckpt.pt")
        return torchledger.AuditSpec(torch.nn.Linear(4, 3), torch.randn(2, 4))
"""


def _file(tmp_path, body, name="m.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_ignore_flag_suppresses_counts_and_does_not_fail(tmp_path):
    path = _file(tmp_path, LOADS)
    r = run("audit", path, "--fail-on", "info", "--steps", "1")
    assert r.exit_code == 1 and "TL-LINT-003" in r.stdout           # the gate fails on it today
    r = run("audit", path, "--fail-on", "info", "--steps", "1", "--ignore", "tl-lint-003")
    assert r.exit_code == 0, r.output
    assert "TL-LINT-003 x1" in r.stdout and "suppressed: 1 finding(s)" in r.stdout
    assert "info    TL-LINT-003" not in r.stdout


def test_ignore_from_pyproject_and_json(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nignore = ["TL-LINT-003"]\n')
    path = _file(tmp_path, LOADS)
    r = run("audit", path, "--fail-on", "info", "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["meta"]["suppressed"] == {"ignore": ["TL-LINT-003"], "count": 1, "rules": {"TL-LINT-003": 1}}
    assert "TL-LINT-003" not in {f["rule"] for f in data["findings"]}


def test_unknown_rule_ids_are_one_line_with_the_valid_ones(tmp_path):
    path = _file(tmp_path, LOADS)
    err = one_line_error(run("audit", path, "--ignore", "TL-NOPE-1"), "unknown rule id 'TL-NOPE-1'",
                         "TL-CMP-001", "TL-LINT-003")
    assert len(known_rules()) > 25 and all(rule in err for rule in known_rules())
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nignore = ["TL-CMP-9"]\n')
    one_line_error(run("audit", path), "ignore: unknown rule id 'TL-CMP-9'", "valid ids")
    (tmp_path / "pyproject.toml").write_text('[tool.torchledger]\nignore = "TL-CMP-001"\n')
    one_line_error(run("audit", path), "ignore: expected a list of rule ids")


@pytest.mark.parametrize("device", ["CPU", "Fake", "META"])
def test_device_is_case_insensitive(tmp_path, device):
    r = run("audit", _file(tmp_path, LOADS), "--device", device, "--steps", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["meta"]["audit"]["device"] == device.lower()


def test_output_into_a_missing_folder_makes_it_as_record_save_does(tmp_path):
    path = _file(tmp_path, LOADS)
    out = tmp_path / "no" / "such" / "out.json"
    r = run("audit", path, "--steps", "1", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["schema"] == "torchledger/1"     # the format from the suffix


def test_output_folder_that_cannot_be_made_fails_before_the_audit(tmp_path):
    body = LOADS.replace("def audit_spec():", "def audit_spec():\n        raise SystemExit('ran')")
    path = _file(tmp_path, body)
    (tmp_path / "a_file").write_text("in the way")
    out = tmp_path / "a_file" / "sub" / "out.json"
    one_line_error(run("audit", path, "--output", str(out)), "cannot create the folder", "is a file")


MOE = """
    import torch, torchledger
    class Experts(torch.nn.Module):
        def __init__(self, dtype=None):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 8, dtype=dtype) * 0.1)
        def forward(self, x):
            offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32, device=x.device)
            return torch._grouped_mm(x, self.w, offs=offs)
    def audit_spec():
        dtype = {dtype}
        return torchledger.AuditSpec(Experts(dtype), torch.randn(16, 8, dtype=dtype))
"""


@pytest.mark.parametrize("device", ["fake", "meta"])
def test_moe_in_fp32_on_fake_gets_a_hint_that_works(tmp_path, device):
    err = one_line_error(run("audit", _file(tmp_path, MOE.replace("{dtype}", "None")), "--device", device),
                         "grouped_mm", "build the model in bf16", "--device cpu")
    assert "--device fake" not in err and "--device meta" not in err
    # both ways out it names work
    assert run("audit", _file(tmp_path, MOE.replace("{dtype}", "None")), "--device", "cpu",
               "--steps", "1").exit_code == 0
    assert run("audit", _file(tmp_path, MOE.replace("{dtype}", "torch.bfloat16"), "bf16.py"),
               "--device", device, "--steps", "1").exit_code == 0


def test_torch_load_severity_follows_the_torch_26_default():
    src = textwrap.dedent("""
        import torch
        a = torch.load("a.pt")
        b = torch.load("b.pt", weights_only=False)
        c = torch.load("c.pt", weights_only=True)
    """)
    found = {f.location: f for f in lint_source(src, "x.py")}
    assert set(found) == {"x.py:3", "x.py:4"}
    omitted, unsafe = found["x.py:3"], found["x.py:4"]
    assert omitted.severity == "info" and "torch >= 2.6" in omitted.message
    assert "unpickles arbitrary objects" not in omitted.message.split(":")[0]
    assert unsafe.severity == "warning" and "unpickles arbitrary objects" in unsafe.message
