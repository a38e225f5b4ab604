"""The tracer under bad timing and after the step: it keeps nothing of the user's alive, other
threads' work stays out of its record, one tracer at a time is a real lock, and a Ctrl-C at
any point of entering or leaving it leaves nothing installed."""
from __future__ import annotations

import gc
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

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


# -- threads ---------------------------------------------------------------------------------
def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _traced_with_neighbour(neighbour):
    """Trace one step while another thread runs ``neighbour()`` in the middle of it."""
    model, opt = _tiny()
    x = torch.randn(3, 4)
    errors = []

    def run():
        try:
            neighbour(model)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            errors.append(e)

    with torchledger.trace(model, optimizer=opt) as t:
        model(x).square().mean().backward()
        other = threading.Thread(target=run)
        other.start()
        other.join()
        opt.step()
        opt.zero_grad()
    assert errors == []
    return t.record


def test_other_threads_optimizer_steps_are_not_recorded():
    """Another thread's 5 untraced AdamW steps landed in the record (6 steps instead of 1)."""
    def neighbour(_):
        m, o = _tiny()
        for _ in range(5):
            _step(m, o, torch.randn(3, 4))

    rec = _traced_with_neighbour(neighbour)
    assert rec.memory["grads"]["optimizer_steps"] == 1
    assert rec.optimizer["names"] == ["AdamW"]
    # the traced optimizer's own state alone: exp_avg, exp_avg_sq (58 fp32 each) and 4 steps
    assert rec.optimizer["state_bytes"] == 2 * 58 * 4 + 4 * 4
    alone = _traced_with_neighbour(lambda _: None)
    assert rec.totals["flops"] == alone.totals["flops"]


def test_other_threads_forward_of_the_same_model_is_not_recorded():
    def neighbour(model):
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(5, 4))

    rec = _traced_with_neighbour(neighbour)
    alone = _traced_with_neighbour(lambda _: None)
    calls = {m["name"]: m["calls"] for m in rec.modules}
    assert calls == {m["name"]: m["calls"] for m in alone.modules}
    assert [calls[n] for n in ("", "0", "1", "2")] == [1, 1, 1, 1]  # the model, 2 Linear, ReLU
    assert rec.totals["flops"] == alone.totals["flops"]


def test_two_threads_entering_at_once_one_gets_in():
    """Both threads got in (a check-then-set race on the active flag) and SDPA stayed
    patched. Thread a is held inside ``__enter__`` (in ModuleScope's walk of its modules)
    while the main thread tries to enter: it must be refused."""
    sdpa = F.scaled_dot_product_attention
    waiting, gate = threading.Event(), threading.Event()

    class Held(nn.Sequential):
        def named_modules(self, *args, **kwargs):
            if threading.current_thread().name == "a" and not gate.is_set():
                waiting.set()
                gate.wait(10)
            return super().named_modules(*args, **kwargs)

    outcome = {}

    def run():
        try:
            with torchledger.trace(Held(nn.Linear(2, 2))):
                outcome["a"] = "in"
        except RuntimeError as e:
            outcome["a"] = str(e)

    a = threading.Thread(target=run, name="a")
    a.start()
    assert waiting.wait(10)
    try:
        with torchledger.trace(nn.Linear(2, 2)):
            outcome["main"] = "in"
    except RuntimeError as e:
        outcome["main"] = str(e)
    finally:
        gate.set()
        a.join()
    assert outcome["a"] == "in" and "already active" in outcome["main"], outcome
    assert F.scaled_dot_product_attention is sdpa
    assert torchledger.tracer.active_tracer() is None

