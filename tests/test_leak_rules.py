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
    """``keep(i)``: whether step i keeps a fresh ``numel``-element fp32 tensor alive (or how
    many elements, when it returns an int)."""
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
            n = keep(i)                                 # True: numel elements; an int: that many
            if n:
                kept.append(torch.zeros(numel if n is True else n))
    for r in ledger.records:
        assert r.warnings == []
        assert "retained" in r.memory and "grads" in r.memory       # the retention analysis ran
    return ledger.records


def growth(records, **options):
    return [f for f in check_leaks(records, options) if f.rule == "TL-LEAK-001"]


def deltas(records):
    ends = [end_bytes(r) for r in records[1:]]
    return [b - a for a, b in zip(ends, ends[1:])]


@pytest.fixture(scope="module")
def steady():
    """Five steps that each keep 4 KiB: traced once, read by the tests of that loop."""
    return run_steps(lambda i: True)


def test_steady_growth_every_step_is_a_leak(steady):
    recs = steady
    assert deltas(recs) == [KIB4, KIB4, KIB4]
    (f,) = growth(recs)
    assert f.measured == KIB4 and f.severity == "warning"
    assert "4,096 bytes per step since step 1 (temporaries)" in f.message   # the one category grown


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
def test_leak_min_bytes_is_the_per_step_floor(steady, min_bytes, fires):
    assert bool(growth(steady, leak_min_bytes=min_bytes)) == fires


def test_slow_steady_growth_under_the_default_floor():
    recs = run_steps(lambda i: True, numel=128)                         # 128 x 4 = 512 bytes a step
    assert deltas(recs) == [512, 512, 512]
    assert growth(recs) == []                                           # default floor 1024
    assert [f.measured for f in growth(recs, leak_min_bytes=512)] == [512]


def test_growth_per_step_is_the_mean_of_the_steps():
    sizes = {2: 1024, 3: 2048, 4: 1024}                  # 4 KiB, 8 KiB, 4 KiB kept
    recs = run_steps(lambda i: sizes.get(i, 0))
    assert deltas(recs) == [4096, 8192, 4096]
    (f,) = growth(recs)
    assert f.measured == (4096 + 8192 + 4096) / 3        # 5461.33 bytes a step


def test_two_steps_are_enough_for_uncleared_gradients():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    for _ in range(2):
        with ledger.step(tokens=4):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()                                   # never zero_grad
    (f,) = check_leaks(ledger.records)
    # step 1's backward accumulated into Linear(16, 16)'s grads: (256 + 16) x 4 = 1,088 bytes
    assert (f.rule, f.measured) == ("TL-LEAK-003", 1088)


class _LateCache(nn.Module):
    """Caches one detached output a step, from the second step on (step 0 warms up)."""

    def __init__(self, first=1, last=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = []
        self.calls = 0
        self.first, self.last = first, last           # the steps that cache (last: None, all)

    def forward(self, x):
        y = self.lin(x)
        if self.first <= self.calls and (self.last is None or self.calls <= self.last):
            self.cache.append(y.detach())
        self.calls += 1
        return y.sum()


def cache_findings(model):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    for _ in range(4):
        with ledger.step():
            model(torch.randn(2, 4)).backward()
            opt.step()
            opt.zero_grad()
    return [f for f in check_leaks(ledger.records) if f.rule == "TL-LEAK-004"]


def test_a_module_cache_growing_after_the_warm_up_step():
    (f,) = cache_findings(_LateCache())
    assert "cache holds more tensors after every step (1 -> 2 -> 3)" in f.message


def test_a_module_cache_that_stops_growing_is_not_reported():
    # caches in steps 0, 1 and 2 of 4: after the warm-up step it holds 2 -> 3 -> 3 tensors
    assert cache_findings(_LateCache(first=0, last=2)) == []
    (f,) = cache_findings(_LateCache(first=0))                  # the twin: 2 -> 3 -> 4
    assert (f.measured, f.expected) == (4, 2)
