"""TL-LEAK-001's rule on real steps: live bytes must grow in EVERY step after the warm-up
step, by at least ``leak_min_bytes`` a step, over three or more steps. A one-off jump, or
growth in some steps only, is not a leak. Each negative has a positive twin on the same loop.

The model is Linear(16, 16) with SGD; what a step keeps is a 4 KiB tensor made inside the
step (torch.zeros(1024) in fp32: 1024 x 4 = 4096 bytes), appended to a list outside it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchledger
from torchledger.analyzers.leaks import check_leaks, end_bytes

KIB4 = 1024 * 4


def run_steps(keep, n_steps=5, numel=1024):
    """``keep(i)``: whether step i keeps a fresh ``numel``-element fp32 tensor alive."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    kept = []
    for i in range(n_steps):
        with ledger.step(tokens=4):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if keep(i):
                kept.append(torch.zeros(numel))
    for r in ledger.records:
        assert r.warnings == []
        assert "retained" in r.memory and "grads" in r.memory       # the retention analysis ran
    return ledger.records


def growth(records, **options):
    return [f for f in check_leaks(records, options) if f.rule == "TL-LEAK-001"]


def deltas(records):
    ends = [end_bytes(r) for r in records[1:]]
    return [b - a for a, b in zip(ends, ends[1:])]


def test_steady_growth_every_step_is_a_leak():
    recs = run_steps(lambda i: True)
    assert deltas(recs) == [KIB4, KIB4, KIB4]
    (f,) = growth(recs)
    assert f.measured == KIB4 and f.severity == "warning"
    assert "4,096 bytes per step since step 1" in f.message


def test_a_one_off_jump_is_not_a_leak():
    recs = run_steps(lambda i: i == 2)
    assert deltas(recs) == [KIB4, 0, 0]           # 4096 / 3 = 1365 a step on average: over 1 KiB
    assert growth(recs) == []


def test_growth_in_two_of_three_steps_is_not_a_leak():
    recs = run_steps(lambda i: i in (2, 3))
    assert deltas(recs) == [KIB4, KIB4, 0]
    assert growth(recs) == []


def test_growth_in_the_warm_up_step_only_does_not_count():
    recs = run_steps(lambda i: i == 0)
    assert deltas(recs) == [0, 0, 0]
    assert growth(recs) == []


def test_needs_three_steps_after_the_warm_up():
    assert growth(run_steps(lambda i: True, n_steps=3)) == []          # two steps after step 0
    assert [f.measured for f in growth(run_steps(lambda i: True, n_steps=4))] == [KIB4]


@pytest.mark.parametrize("min_bytes, fires", [(KIB4 - 1, True), (KIB4, True), (KIB4 + 1, False)])
def test_leak_min_bytes_is_the_per_step_floor(min_bytes, fires):
    recs = run_steps(lambda i: True)
    assert bool(growth(recs, leak_min_bytes=min_bytes)) == fires


def test_slow_steady_growth_under_the_default_floor():
    recs = run_steps(lambda i: True, numel=128)                         # 128 x 4 = 512 bytes a step
    assert deltas(recs) == [512, 512, 512]
    assert growth(recs) == []                                           # default floor 1024
    assert [f.measured for f in growth(recs, leak_min_bytes=512)] == [512]
