"""Saving a record into a folder that does not exist yet (issue 20, item 7): ``Ledger.save("runs/")``
as README shows it and ``record.save("a/b/step.json")`` create the folders; a folder that
cannot be made is one error naming it, never a temporary file. A direct ``write_atomic`` (what
``--output`` uses) into a missing folder names the folder too."""
from __future__ import annotations

import json
import os

import pytest
import torch

import torchledger
from torchledger.render import write_atomic


@pytest.fixture(scope="module")
def ledger():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    led = torchledger.Ledger(model, optimizer=opt)
    with led.step(tokens=2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return led


def test_ledger_save_into_a_new_folder_as_readme_shows(tmp_path, ledger, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = ledger.save("runs/")
    assert out == os.path.join("runs", "rank0.json")
    data = json.loads((tmp_path / "runs" / "rank0.json").read_text())
    assert data["totals"]["params"] == 4 * 3 + 3        # weight + bias
    assert os.listdir(tmp_path / "runs") == ["rank0.json"]


def test_record_save_makes_nested_folders(tmp_path, ledger):
    target = tmp_path / "a" / "b" / "step.json"
    assert ledger.records[-1].save(str(target)) == str(target)
    assert json.loads(target.read_text())["schema"] == "torchledger/1"
    assert sorted(os.listdir(target.parent)) == ["step.json"]


def test_a_file_in_the_way_is_one_error_naming_the_folder(tmp_path, ledger):
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(OSError) as e:
        ledger.save(str(tmp_path / "runs" / "step.json"))
    text = str(e.value)
    assert "cannot create the folder" in text and str(tmp_path / "runs") in text
    assert ".tmp" not in text and "torchledger-" not in text
    assert (tmp_path / "runs").read_text() == "not a folder"


def test_write_atomic_into_a_missing_folder_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        write_atomic(tmp_path / "nope" / "r.json", "{}")
    assert "the folder" in str(e.value) and "nope" in str(e.value) and ".tmp" not in str(e.value)
    assert not (tmp_path / "nope").exists()
