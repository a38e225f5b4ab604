"""Lint wording that misled new users (issue 31, item 9), each on a minimal file of the same shape:

* TL-LINT-003 called a bare ``torch.load`` "safe on torch >= 2.6" in a file (or tree) that
  pickles whole modules: that default (weights_only=True) refuses such a file, so the load fails;
* TL-LINT-004 flagged ``.cpu()`` in the forward of a module served over
  ``torch.distributed.rpc``, which takes CPU tensors by design.

The failure the TL-LINT-003 warning names is checked against torch itself: the whole-module
pickle such a file writes does fail to load with torch.load's default on this torch.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from click.testing import CliRunner

from torchledger.cli import cli
from torchledger.lint import lint_paths, lint_source

SAVES_MODULE = '''\
import torch
from torch import nn

model = nn.Linear(4, 4)
torch.save(model, "model.pt")
restored = torch.load("model.pt")
'''

LOADS_ONLY = '''\
import torch

model = torch.load("model.pt")
model.eval()
'''

SAVES_ELSEWHERE = '''\
import torch
from torch import nn

model = nn.Linear(4, 4)
torch.save(model, "model.pt")
'''

STATE_DICT_LOAD = '''\
import torch
from torch import nn

model = nn.Linear(4, 4)
torch.save(model, "full.pt")
model.load_state_dict(torch.load("weights.pt"))
ckpt = torch.load("ckpt.pt")
model.load_state_dict(ckpt["model"])
'''


def _load_findings(findings):
    return [f for f in findings if f.rule == "TL-LINT-003"]


def test_bare_load_beside_a_module_save_warns_it_fails():
    (f,) = _load_findings(lint_source(SAVES_MODULE, "train.py"))
    assert f.severity == "warning"                       # was info: "safe on torch >= 2.6"
    assert "safe on torch" not in f.message
    assert "torch.save of a model at train.py:5" in f.message
    assert "torch >= 2.6 loads with weights_only=True and fails on such a file" in f.message
    assert "load_state_dict(torch.load(path, weights_only=True))" in f.hint
    assert "weights_only=False" in f.hint


def test_bare_load_alone_stays_a_portability_note():
    (f,) = _load_findings(lint_source(LOADS_ONLY, "eval.py"))
    assert f.severity == "info" and "safe on torch >= 2.6" in f.message


def test_state_dict_loads_stay_info_beside_a_module_save():
    found = _load_findings(lint_source(STATE_DICT_LOAD, "resume.py"))
    assert [(f.location, f.severity) for f in found] == [("resume.py:6", "info"), ("resume.py:7", "info")]


def test_tree_save_in_another_file_makes_the_load_a_warning(tmp_path):
    (tmp_path / "save.py").write_text(SAVES_ELSEWHERE)
    (tmp_path / "serve.py").write_text(LOADS_ONLY)
    save_at = f"{tmp_path / 'save.py'}:5"
    (f,) = _load_findings(lint_paths([str(tmp_path)]))
    assert f.location == f"{tmp_path / 'serve.py'}:3"
    assert f.severity == "warning" and save_at in f.message
    # the file alone knows nothing of the tree: a note
    (alone,) = _load_findings(lint_paths([str(tmp_path / "serve.py")]))
    assert alone.severity == "info"
    # the CLI lints the tree as one: the same warning, and --fail-on warning fails
    res = CliRunner().invoke(cli, ["lint", str(tmp_path), "--fail-on", "warning"])
    assert res.exit_code == 1, res.output
    assert "warning TL-LINT-003" in res.output and save_at in res.output


def test_the_named_failure_is_torchs_own(tmp_path):
    # what the warning promises: torch.load's default refuses a pickled module on this torch
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(4, 4), path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(path)
    assert isinstance(torch.load(path, weights_only=False), torch.nn.Linear)


RPC_MODULE = '''\
import torch
import torch.distributed.rpc as rpc
from torch import nn

class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4).cuda()
    def forward(self, x):
        out = self.fc(x.cuda())
        if out.sum() > 0:
            out = out * 2
        return out.cpu()

def run(x):
    return rpc.rpc_sync("ps", ParameterServer.forward, args=(x,))
'''

RREF_MODULE = '''\
import torch
from torch import nn
from torch.distributed.rpc import RRef

class Shard(nn.Module):
    def forward(self, x_rref):
        x = x_rref.to_here().to("cuda")
        return self.net(x).to("cpu")

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]
'''


def _syncs(text):
    return [f for f in lint_source(text, "m.py") if f.rule == "TL-LINT-004"]


def test_rpc_module_cpu_copy_is_not_noise():
    found = _syncs(RPC_MODULE)
    assert ["cpu()" in f.message for f in found] == [False]        # .cpu() dropped
    assert "out.sum() > 0" in found[0].message                     # the branch is still a sync
    assert not _syncs(RREF_MODULE)                                  # .to("cpu") beside an RRef


def test_without_rpc_the_cpu_copy_is_flagged():
    plain = RPC_MODULE.replace("import torch.distributed.rpc as rpc\n", "").replace(
        'rpc.rpc_sync("ps", ParameterServer.forward, args=(x,))', "ParameterServer()(x)")
    assert sum("out.cpu()" in f.message for f in _syncs(plain)) == 1
    # a name that only looks like RPC's (a local `remote`) is not RPC
    local = plain.replace("def run(x):", "def remote(x):\n    return x\n\ndef run(x):")
    assert sum("out.cpu()" in f.message for f in _syncs(local)) == 1
