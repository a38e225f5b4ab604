"""Leak findings over real CPU steps: each pattern caught at its line, clean loops silent."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchledger
from torchledger.analyzers.leaks import check_leaks
from torchledger.models import build_model, example_inputs, get_config

# gpt2-tiny with one block: every op kind of the two-block preset, half the ops a step to trace
GPT = get_config("gpt2-tiny").replace(n_layers=1)


def make():
    torch.manual_seed(0)
    model = build_model(GPT)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch():
    return example_inputs(GPT, batch=2, seq_len=8)


def rules(ledger):
    return sorted({f.rule for f in check_leaks(ledger.records)})


def _line(marker):
    return next(i for i, s in enumerate(open(__file__).read().splitlines(), 1)
                if s.rstrip().endswith(f"# {marker}"))


def test_loss_kept_with_its_graph():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    losses = []
    for _ in range(5):
        with ledger.step(tokens=16):
            loss = model(**batch())                                   # LOSS-MADE
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss)
    found = check_leaks(ledger.records)
    assert [f.rule for f in found] == ["TL-LEAK-002"]                 # 4 bytes/step: below 1 KiB
    assert found[0].location.endswith(f"test_leaks.py:{_line('LOSS-MADE')}")
    assert "step(s) 0, 1, 2, 3" in found[0].message


def test_activations_kept_across_steps_grow():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    kept = []
    for _ in range(5):
        with ledger.step(tokens=16):
            logits = model(batch()["idx"])
            logits.float().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        kept.append(logits)                                           # (2, 8, 512) fp32 a step
    found = {f.rule: f for f in check_leaks(ledger.records)}
    assert set(found) == {"TL-LEAK-001", "TL-LEAK-002"}
    assert found["TL-LEAK-001"].measured == 2 * 8 * 512 * 4           # 32 KiB per step


def test_gradients_never_cleared():
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    for _ in range(3):
        with ledger.step(tokens=16):
            model(**batch()).backward()
            opt.step()                                                # no zero_grad anywhere
    assert rules(ledger) == ["TL-LEAK-003"]


def test_module_cache_that_grows():
    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.seen = []

        def forward(self, x):
            y = self.lin(x)
            self.seen.append(y.detach())
            return y.sum()
    model = Caching()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = torchledger.Ledger(model, optimizer=opt)
    for _ in range(4):
        with ledger.step():
            model(torch.randn(4, 8)).backward()
            opt.step()
            opt.zero_grad()
    found = [f for f in check_leaks(ledger.records) if f.rule == "TL-LEAK-004"]
    assert len(found) == 1 and "seen" in found[0].message


def clean_loops():
    def item_logging(model, opt, ledger, log):
        for _ in range(5):
            with ledger.step():
                loss = model(**batch())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            log.append(loss.item())

    def zero_grad_top(model, opt, ledger, log):
        for _ in range(5):
            with ledger.step():
                opt.zero_grad()
                model(**batch()).backward()
                opt.step()

    def zero_grad_keep(model, opt, ledger, log):
        for _ in range(5):
            with ledger.step():
                model(**batch()).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)

    def model_zero_grad(model, opt, ledger, log):
        for _ in range(5):
            with ledger.step():
                model(**batch()).backward()
                opt.step()
                model.zero_grad()

    def accumulation(model, opt, ledger, log):
        for i in range(8):
            with ledger.step():
                (model(**batch()) / 2).backward()
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    def scheduler(model, opt, ledger, log):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        for _ in range(5):
            with ledger.step():
                model(**batch()).backward()
                opt.step()
                opt.zero_grad()
                sched.step()

    def detached_history(model, opt, ledger, log):
        for _ in range(5):
            with ledger.step():
                loss = model(**batch())
                loss.backward()
                opt.step()
                opt.zero_grad()
            log.append(loss.detach())
    return [item_logging, zero_grad_top, zero_grad_keep, model_zero_grad, accumulation, scheduler,
            detached_history]


@pytest.mark.parametrize("loop", clean_loops(), ids=lambda f: f.__name__)
def test_clean_loops_have_no_leak_finding(loop):
    model, opt = make()
    ledger = torchledger.Ledger(model, optimizer=opt)
    loop(model, opt, ledger, [])
    assert check_leaks(ledger.records) == []
    # the analysis ran: no internal error turned into a warning, and it counted every
    # optimizer step (5 a loop; accumulation: 8 steps, an optimizer step every second one)
    assert [r.warnings for r in ledger.records] == [[]] * len(ledger.records)
    steps = sum(r.memory["grads"]["optimizer_steps"] for r in ledger.records)
    assert steps == (4 if loop.__name__ == "accumulation" else 5)


class _RootRelu(nn.Module):
    """The ReLU runs in the root module's own forward: its tensors' module is ""."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_growth_message_names_the_root_module_once_per_site():
    torch.manual_seed(0)
    model = _RootRelu()
    ledger = torchledger.Ledger(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    total = 0.0
    for i in range(5):
        with ledger.step(tokens=16):
            x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
            total = total + nn.functional.cross_entropy(model(x), y)   # an eval loop keeping graphs
    growth = next(f for f in check_leaks(ledger.records) if f.rule == "TL-LEAK-001")
    sites = growth.message.split("kept from earlier steps: ")[1].split(", ")
    assert "(root) (aten.relu.default)" in sites
    assert not any(s.startswith("?") or s.endswith("(None)") for s in sites)
    assert len(sites) == len(set(sites))


def test_a_finished_step_is_freed_without_the_cyclic_collector():
    """A tracer and the record a Ledger drops are freed when the last reference goes, not at the
    next full collection: no reference cycle is left behind by a traced step (a saved-tensor hook
    kept as a bound method on its tracer was one, and held every dropped record until then)."""
    import gc
    import weakref
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()
    gc.disable()
    try:
        with torchledger.trace(model, optimizer=opt) as t:
            model(x).sum().backward()
            opt.step()
        tracer, record = weakref.ref(t), weakref.ref(t.record)
        del t
        assert tracer() is None and record() is None

        from torchledger.ledger import LEAK_WINDOW
        ledger = torchledger.Ledger(model, optimizer=opt, keep=2)
        steps = []
        for _ in range(LEAK_WINDOW + 3):
            with ledger.step():
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            steps.append(weakref.ref(ledger.records[-1]))
        # kept: the last LEAK_WINDOW (the leak rules' window, 8), of which the last 2 in records
        alive = [r() is not None for r in steps]
        assert alive == [False] * 3 + [True] * LEAK_WINDOW
    finally:
        gc.enable()
