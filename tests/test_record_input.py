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


_NESTED = ("flops", "attention_flops", "elementwise_flops")
_STRINGS = ("peak_phase", "peak_module", "tokens_source")
_OBJECTS = ("memory", "predictions")


def expected_refusal(name: str):
    """The one-line error a mutation must be refused with, or None where it must load.

    A dropped key loads (readers default it) except the schema; a wrong type is refused
    naming the field, what was expected and what arrived, except where the value is of an
    accepted type (3 for a number, 'x' for a string)."""
    kind = {int: "int", str: "str", list: "list"}
    if name == "drop schema":
        return "expected schema 'torchledger/1', got None; is this a torchledger record?"
    if name.startswith("drop ") or name == "empty totals.flops":
        return None
    field, value = name.split("=", 1)
    value = eval(value)                        # the repr the name was made with: 3, 'x', [1]
    got = kind[type(value)]
    if field.startswith("totals."):
        key = field[len("totals."):]
        if key in _NESTED:
            return f"{field}: expected an object of numbers, got {got}"
        if key in _STRINGS:
            return None if isinstance(value, str) else f"{field}: expected a string, got {got}"
        return None if isinstance(value, int) else f"{field}: expected a number, got {got}"
    if field in _OBJECTS:
        return f"{field}: expected an object, got {got}"
    if isinstance(value, list):
        return f"{field}[0]: expected an object, got int"
    return f"{field}: expected a list, got {got}"


@pytest.mark.parametrize("name, data", mutations(), ids=[m[0] for m in mutations()])
def test_malformed_records_fail_cleanly_or_render(name, data):
    refusal = expected_refusal(name)
    if refusal is not None:
        with pytest.raises(ValueError) as e:
            StepRecord.from_dict(data)
        assert str(e.value) == refusal
        return
    rec = StepRecord.from_dict(data)            # must load: the field is absent or well typed
    if name.startswith("totals.") and "=" in name:
        key, value = name[len("totals."):].split("=", 1)
        assert rec.totals[key] == eval(value)
    findings = run_checks([rec])
    for render in RENDERERS.values():
        assert isinstance(render(rec, findings), str)


def test_both_outcomes_are_exercised():
    outcomes = [expected_refusal(name) is None for name, _ in mutations()]
    assert outcomes.count(True) >= 40 and outcomes.count(False) >= 60
