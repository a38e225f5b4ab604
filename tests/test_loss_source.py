"""The loss an audit backpropagates is the one the model returns, and every report names it."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from click.testing import CliRunner

from torchledger.audit.engine import run_audit
from torchledger.audit.spec import AuditError, pick_loss
from torchledger.cli import cli

LOGITS = torch.randn(2, 3, 5)
LOSS = torch.tensor(2.5)


@pytest.mark.parametrize("output, source", [
    ((LOGITS, LOSS), "output[1]"),                     # nanoGPT's (logits, loss)
    ([LOSS, LOGITS], "output[0]"),                     # HF return_dict=False with labels
    ((LOGITS, None, LOSS), "output[2]"),
    ({"logits": LOGITS, "loss": LOSS}, 'output["loss"]'),
    (LOSS, "output"),
])
def test_the_models_own_loss_is_picked(output, source):
    loss, said = pick_loss(output)
    assert loss is LOSS and said == source


def test_hf_model_output_loss():
    from transformers.modeling_outputs import CausalLMOutput
    loss, said = pick_loss(CausalLMOutput(loss=LOSS, logits=LOGITS))
    assert loss is LOSS and said == "output.loss"


@pytest.mark.parametrize("output, source", [
    ((LOGITS, None), "output[0]"),                     # nanoGPT without targets: no loss
    (LOGITS, "output"),
    ({"logits": LOGITS}, 'output["logits"]'),
    ((LOGITS, torch.tensor(3)), "output[0]"),          # an integer scalar (a count) is no loss
])
def test_without_a_loss_the_logits_mean_says_so(output, source):
    loss, said = pick_loss(output)
    assert torch.equal(loss, LOGITS.float().mean())
    assert said == f"{source}.float().mean() (no loss in the output)"


def test_no_tensor_at_all_is_an_audit_error():
    with pytest.raises(AuditError, match="loss_fn"):
        pick_loss(("a", 1))


#: the loss depends on `scale`, the logits do not: only the model's own loss gives it a gradient
TUPLE_MODEL = """
    import torch, torchledger
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.scale = torch.nn.Parameter(torch.ones(()))
        def forward(self, x, y):
            logits = self.fc(x)
            return logits, self.scale * torch.nn.functional.cross_entropy(logits, y)
    def audit_spec():
        return torchledger.AuditSpec(M(), (torch.randn(2, 4), torch.tensor([0, 2])){extra})
"""


def _file(tmp_path, extra=""):
    p = tmp_path / "m.py"
    p.write_text(textwrap.dedent(TUPLE_MODEL).replace("{extra}", extra))
    return str(p)


def test_audit_backpropagates_output_1_and_records_it(tmp_path):
    run = run_audit(_file(tmp_path), device="cpu", steps=1, timing_steps=0)
    assert run.record.meta["audit"]["loss"] == "output[1]"
    model = run.spec.model
    # AdamW moved `scale` away from 1: it had a gradient, which logits.mean() would not give it
    assert model.scale.item() != 1.0


@pytest.mark.parametrize("fmt, expected", [("table", "loss: output[1]"), ("markdown", "\nloss: output[1]\n"),
                                           ("html", '<p class="meta">loss: output[1]</p>')])
def test_every_report_names_the_loss(tmp_path, fmt, expected):
    r = CliRunner().invoke(cli, ["audit", _file(tmp_path), "--format", fmt, "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert expected in r.stdout


def test_json_and_a_loss_fn(tmp_path):
    path = _file(tmp_path, ", loss_fn=lambda out, inputs: out[0].sum()")
    r = CliRunner().invoke(cli, ["audit", path, "--format", "json", "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["meta"]["audit"]["loss"] == "AuditSpec.loss_fn"
