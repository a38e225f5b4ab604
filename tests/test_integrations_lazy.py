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
