"""The record's views and copies are the step's own, not the tracer's (issue 31 item 7).

With a saved-tensor hook installed, autograd re-wraps every saved input it unpacks with an
``aten.detach`` it does not issue without hooks (``SavedVariable::unpack``); the tracer's pack
hook also detaches saved outputs where autograd, without hooks, issues the same detach itself
(``tensor_data()``). The reference is the same traced step with the tracer's saved-tensor hooks
left out: its view and copy counts must be the same, op by op and phase by phase.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchledger
from torchledger.models import build_model, example_inputs
from torchledger.tracer import lifecycle
from torchledger.tracer.dispatch import LedgerMode


def _views_and_copies(rec) -> dict:
    """What the record says moved no bytes (views, per phase and per op) and what copied."""
    free = {}
    for o in rec.ops:
        if o["kind"] == "free":
            key = (o["phase"], o["op"])
            free[key] = free.get(key, 0) + o["count"]
    copies = {(c["op"], c["phase"], c["reason"]): c["count"] for c in rec.copies}
    return {"view_ops": dict(rec.totals["view_ops"]), "free": free, "copies": copies}


def _no_saved_tensor_hooks(monkeypatch):
    monkeypatch.setattr(lifecycle.Installed, "saved_tensors_hooks", lambda self, pack, unpack: None)


def _step(make, fake: bool):
    torch.manual_seed(0)
    mode = FakeTensorMode() if fake else None
    if mode is not None:
        mode.__enter__()
    try:
        model, opt, run = make()
        with torchledger.trace(model, optimizer=opt) as t:
            run(model)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    return t.record


def _preset(name):
    def make():
        model = build_model(name)
        inputs = example_inputs(name, 2, 16)
        return model, torch.optim.AdamW(model.parameters()), lambda m: m(**inputs).backward()
    return make


class _TwoLinear(nn.Module):
    def __init__(self, checkpoint=None):
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 4, bias=False)
        self.checkpoint = checkpoint

    def body(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        if self.checkpoint is None:
            return self.body(x)
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.body, x, use_reentrant=self.checkpoint == "reentrant")


def _two_linear(checkpoint=None):
    def make():
        model = _TwoLinear(checkpoint)
        x = torch.randn(3, 8, requires_grad=checkpoint == "reentrant")    # reentrant needs one
        y = torch.randint(0, 4, (3,))
        # the loss outside any module: its saved output's detach is still forward work
        return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m: F.cross_entropy(m(x), y).backward()
    return make


CASES = {
    "gpt2-tiny": _preset("gpt2-tiny"),
    "llama-tiny": _preset("llama-tiny"),
    "two-linear": _two_linear(),
    "checkpointed": _two_linear("non-reentrant"),
    "reentrant": _two_linear("reentrant"),
}


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("case", list(CASES))
def test_views_and_copies_are_the_same_with_the_hooks_off(case, fake, monkeypatch):
    on = _views_and_copies(_step(CASES[case], fake))
    _no_saved_tensor_hooks(monkeypatch)
    off = _views_and_copies(_step(CASES[case], fake))
    assert on == off


def test_detaches_by_hand():
    """relu(x A^T) B^T, x needs no grad. Without hooks autograd detaches: relu's saved output
    once in forward (``tensor_data()``) and once when its backward unpacks it, and each of the
    two weights' gradient once (AccumulateGrad): 1 forward, 3 backward. With the hooks, the
    unpacks of mm's saved inputs relu(x A^T) and B^T would add 2 backward detaches (5)."""
    model = _TwoLinear()
    with torchledger.trace(model) as t:
        model(torch.randn(3, 8)).sum().backward()
    free = _views_and_copies(t.record)["free"]
    assert free[("forward", "aten.detach.default")] == 1
    assert free[("backward", "aten.detach.default")] == 3


def test_a_planted_recount_fails(monkeypatch):
    """Counting the unpack's detaches again (the check above undone) is caught: the hooks-on
    record then has more backward views than the hooks-off one."""
    monkeypatch.setattr(LedgerMode, "_unpack_detach", lambda self, func, args: False)
    on = _views_and_copies(_step(CASES["two-linear"], False))
    _no_saved_tensor_hooks(monkeypatch)
    off = _views_and_copies(_step(CASES["two-linear"], False))
    # the saved inputs that need grad: relu(x A^T) and B^T (mm), the log-probabilities (nll_loss)
    assert on["view_ops"]["backward"] == off["view_ops"]["backward"] + 3
    assert on != off


def test_a_planted_quiet_forward_detach_fails(monkeypatch):
    """Leaving out the pack hook's detach (as the tracer did: ``mode.quiet``) loses the forward
    detach autograd makes itself without hooks."""
    from torchledger.tracer import step

    real = step.StepTracer._detached

    def quiet(self, t):
        self.mode.quiet += 1
        try:
            return real(self, t)
        finally:
            self.mode.quiet -= 1
    monkeypatch.setattr(step.StepTracer, "_detached", quiet)
    model = _TwoLinear()
    with torchledger.trace(model) as t:
        model(torch.randn(3, 8)).sum().backward()
    assert ("forward", "aten.detach.default") not in _views_and_copies(t.record)["free"]
