"""Saved records are user input: a malformed one is one clear error, never a crash later."""
from __future__ import annotations

import copy
import json
import os

import pytest

from torchledger.analyzers.checks import run_checks
from torchledger.record import StepRecord
from torchledger.render import RENDERERS

DATA = os.path.join(os.path.dirname(__file__), "data", "gpt2-tiny", "record.json")


def mutations():
    base = json.load(open(DATA))
    out = []
    for key in list(base):
        d = copy.deepcopy(base)
        del d[key]
        out.append((f"drop {key}", d))
    for key in list(base["totals"]):
        d = copy.deepcopy(base)
        del d["totals"][key]
        out.append((f"drop totals.{key}", d))
        for wrong in ("x", [1], 3):
            d = copy.deepcopy(base)
            d["totals"][key] = wrong
            out.append((f"totals.{key}={wrong!r}", d))
    for section in ("modules", "ops", "copies", "findings", "memory", "predictions"):
        for wrong in (5, "x", [5]):
            d = copy.deepcopy(base)
            d[section] = wrong
            out.append((f"{section}={wrong!r}", d))
    d = copy.deepcopy(base)
    d["totals"]["flops"] = {}
    out.append(("empty totals.flops", d))
    return out


@pytest.mark.parametrize("name, data", mutations(), ids=[m[0] for m in mutations()])
def test_malformed_records_fail_cleanly_or_render(name, data):
    try:
        rec = StepRecord.from_dict(data)
    except ValueError:
        return                                  # one clear error: what the CLI prints
    findings = run_checks([rec])
    for render in RENDERERS.values():
        assert isinstance(render(rec, findings), str)
