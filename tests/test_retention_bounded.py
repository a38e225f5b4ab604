"""The retention check costs what the step made, never a walk of the whole Python heap
(issue 25): no ``gc.get_objects()``, no full ``gc.collect()``; a kept loss is still found
with its graph."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import torchledger
from torchledger.analyzers.leaks import check_leaks


@pytest.fixture
def gc_calls(monkeypatch):
    calls = []
    collect, get_objects = gc.collect, gc.get_objects
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(("collect", generation)) or collect(generation))
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: calls.append(("get_objects",)) or get_objects(*a, **k))
    return calls


def _loop(steps: int, kept=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    ledger = torchledger.Ledger(model, optimizer=opt)
    x = torch.randn(4, 16)                    # the same input every step, saved by autograd
    for _ in range(steps):
        with ledger.step(tokens=4):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if kept is not None:
            kept.append(loss)
    return ledger


def test_same_input_every_step_walks_nothing(gc_calls):
    ledger = _loop(4)
    # the input, saved by autograd, is alive at every step's end: carried and seen again, so
    # each step from the second collects the young generations once, and nothing more
    # (and op_segments collects the youngest generation twice a step, to untrack its tuples)
    assert ("get_objects",) not in gc_calls
    assert [c for c in gc_calls if c != ("collect", 0)] == [("collect", 1)] * 3
    assert gc_calls.count(("collect", 0)) == 2 * 4
    retained = ledger.records[-1].memory["retained"]
    assert [(g["count"], g["bytes"], g["holds_graph"]) for g in retained] == [(1, 4 * 16 * 4, False)]
    assert not [f for f in ledger.findings() if f.rule.startswith("TL-LEAK")]


def test_kept_losses_found_with_young_collections_only(gc_calls):
    kept: list = []
    ledger = _loop(5, kept)
    assert [f.rule for f in check_leaks(ledger.records)] == ["TL-LEAK-002"]
    assert ("get_objects",) not in gc_calls
    assert ("collect", 1) in gc_calls
    assert all(c in (("collect", 0), ("collect", 1)) for c in gc_calls)   # never the oldest generation
    g = ledger.records[-1].memory["retained"]
    # steps 0-3's losses (4 bytes each) with their graphs, and the input (4*16*4 bytes) without
    assert sorted((x["bytes"], x["holds_graph"]) for x in g) == [(4, True)] * 4 + [(256, False)]


def test_kept_detached_losses_hold_no_graph(gc_calls):
    kept: list = []
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    for _ in range(4):
        with ledger.step(tokens=4):
            loss = model(torch.randn(4, 8)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        kept.append(loss.detach())            # the storage is kept, the graph is not
    retained = ledger.records[-1].memory["retained"]
    assert sum(x["count"] for x in retained) == 3 and not any(x["holds_graph"] for x in retained)
    assert "TL-LEAK-002" not in {f.rule for f in check_leaks(ledger.records)}
