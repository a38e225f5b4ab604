"""``optimizer.step(closure)``: the closure's forward and backward keep their own phases.

Lightning's automatic optimization and LBFGS run the step's forward and backward inside
``optimizer.step``; before this was handled they were all counted as optimizer work.
"""
from __future__ import annotations

import pytest
import torch

import torchledger


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss
    return model, opt, closure


@pytest.mark.parametrize("how", ["keyword", "positional", "plain"])
def test_closure_work_is_forward_and_backward(how):
    model, opt, closure = _setup()
    with torchledger.trace(model, opt) as t:
        if how == "keyword":
            loss = opt.step(closure=closure)
        elif how == "positional":
            loss = opt.step(closure)
        else:
            loss = closure()
            opt.step()
    flops = t.record.totals["flops"]
    # forward: 2*3*8*16 + 2*3*16*4 = 768 + 384 = 1152
    assert flops["forward"] == 1152
    # backward: both weight grads (768 + 384) + the second layer's input grad (384); x needs none
    assert flops["backward"] == 1536
    assert flops["optimizer"] == 0
    assert loss is not None


def test_closure_step_unchanged_by_tracing():
    results = []
    for traced in (False, True):
        model, opt, closure = _setup()
        if traced:
            with torchledger.trace(model, opt):
                loss = opt.step(closure=closure)
        else:
            loss = opt.step(closure=closure)
        results.append((loss.detach(), [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = results
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_lbfgs_closure_calls_counted_per_call():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=1)
    x = torch.randn(3, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss
    with torchledger.trace(model, opt) as t:
        opt.step(closure)
    # max_iter=1: LBFGS evaluates the closure once; forward 2*3*8*4 = 192, backward the
    # weight grad only (x needs none) = 192
    assert t.record.totals["flops"]["forward"] == 192
    assert t.record.totals["flops"]["backward"] == 192


class _Wrapper(torch.optim.Optimizer):
    """The shape of accelerate's AcceleratedOptimizer: an Optimizer subclass that delegates to
    ``.optimizer`` and shares its state."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


def test_a_wrapped_optimizer_state_is_counted_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    inner = torch.optim.Adam(model.parameters())
    opt = _Wrapper(inner)
    with torchledger.trace(model, opt) as t:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    # Adam: exp_avg + exp_avg_sq, 32 fp32 each, + one fp32 step scalar: 2*32*4 + 4 = 260
    assert t.record.totals["optimizer_state_bytes"] == 260
    assert t.record.optimizer["names"] == ["Adam"]
