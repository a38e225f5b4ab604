"""The tracer under bad timing and after the step: it keeps nothing of the user's alive, other
threads' work stays out of its record, one tracer at a time is a real lock, and a Ctrl-C at
any point of entering or leaving it leaves nothing installed."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

import torchledger


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


# -- references ------------------------------------------------------------------------------
def test_finished_trace_keeps_no_model_optimizer_or_state_alive():
    model, opt = _tiny()
    x = torch.randn(3, 4)
    with torchledger.trace(model, optimizer=opt) as t:
        model(x).sum().backward()
        opt.step()
    state = next(iter(opt.state.values()))["exp_avg"]       # made by the traced step
    refs = {"model": weakref.ref(model), "optimizer": weakref.ref(opt),
            "weight": weakref.ref(model[0].weight), "grad": weakref.ref(model[0].weight.grad),
            "state": weakref.ref(state)}
    del model, opt, state
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert alive == [], f"kept alive by the finished trace: {alive}"
    assert t.record.totals["params"] == 4 * 8 + 8 + 8 * 2 + 2     # the record is still there
    assert "Linear" in t.report() and isinstance(t.findings(), list)   # rendered from the record alone


def test_trace_that_raised_keeps_nothing_alive():
    model, opt = _tiny()
    try:
        with torchledger.trace(model, optimizer=opt) as t:
            model(torch.randn(3, 4)).sum().backward()
            raise ValueError("user error")
    except ValueError:
        pass
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model[2].bias)]
    del model, opt
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert t.record.meta["failed"] is True

