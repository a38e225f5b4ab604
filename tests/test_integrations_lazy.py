"""``torchledger.integrations`` imports nothing by itself, and a missing framework gets an
ImportError that says what to install (runs without any framework installed)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_package_imports_nothing_heavy():
    code = ("import sys, torchledger.integrations, torchledger.integrations._common; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning', 'pytorch_lightning', "
            "'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module, missing, says", [
    ("hf", ("transformers",), "pip install transformers accelerate"),
    ("lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"), "pip install lightning"),
])
def test_missing_framework_says_what_to_install(monkeypatch, module, missing, says):
    name = f"torchledger.integrations.{module}"
    monkeypatch.delitem(sys.modules, name, raising=False)
    for m in missing:
        monkeypatch.setitem(sys.modules, m, None)       # import of it raises ImportError
    with pytest.raises(ImportError, match=says):
        importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_batch_tokens_reads_token_ids_only():
    import torch
    from torchledger.integrations._common import batch_tokens
    ids = torch.zeros(2, 8, dtype=torch.long)           # 2 x 8 = 16 token ids

    class Encoding:
        input_ids = ids
    assert batch_tokens({"input_ids": ids, "labels": ids}) == (16, "input_ids.numel()")
    assert batch_tokens(Encoding()) == (16, "batch.input_ids.numel()")
    assert batch_tokens(ids) == (16, "batch.numel()")
    assert batch_tokens((ids, ids[:, :4])) == (16, "batch[0].numel()")
    assert batch_tokens({"pixel_values": torch.zeros(2, 3)}) == (None, "the batch has no tensor 'input_ids'")
    assert batch_tokens(torch.zeros(2, 3)) == (None, "the batch is a torch.float32 tensor, not token ids")
    assert batch_tokens([torch.zeros(2, 3), ids]) == (None, "batch[0] is a torch.float32 tensor, not token ids")
    assert batch_tokens(None) == (None, "no token ids found in a batch of type NoneType")


def test_bad_options_say_which_and_why():
    from torchledger.integrations._common import LedgerRun
    with pytest.raises(ValueError, match=r"sample_every must be an int >= 1 .* got 0"):
        LedgerRun("x", sample_every=0)
    with pytest.raises(ValueError, match=r"keep must be an int >= 1"):
        LedgerRun("x", keep=True)
    with pytest.raises(ValueError, match=r"peak_flops must be a positive number .* got -1"):
        LedgerRun("x", peak_flops=-1)
