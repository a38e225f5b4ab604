"""torch.compile is never silently lost: the traced step runs eagerly (force_eager), dynamo's
cache is untouched, the untraced steps around it run compiled, and the record and report say
so. Counted with dynamo's own CompileCounter backend and counters."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import torchledger


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(torch.nn.Module):
    """A model class of the user's own: dynamo compiles its forward (torch.nn's own modules are
    in dynamo's skip list, so ``Sequential.compile()`` alone would compile nothing)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _mlp():
    torch.manual_seed(0)
    return MLP()


def _step(call, model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        call(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return step, opt


X = torch.randn(4, 8)


def test_first_step_traced_then_untraced_steps_compile():
    model, cnt = _mlp(), CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    step, opt = _step(compiled, model, X)
    with torchledger.trace(compiled, opt) as t:
        step()
    assert cnt.frame_count == 0                 # the traced step did not compile (ran eagerly)
    for _ in range(3):
        step()
    # without the fix dynamo skipped the frame for good: frame_count stayed 0 for every step
    assert cnt.frame_count == 1 and cnt.op_count == 3          # linear, gelu, linear
    assert counters["stats"]["unique_graphs"] == 1
    rec = t.record
    assert rec.meta["compiled"]["modules"] == ["(root)"] and rec.meta["compiled"]["traced_step"] == "eager"
    # traced as the original module: no _orig_mod. prefix, same FLOPs as the plain model
    assert [m["name"] for m in rec.modules] == ["", "up", "down"] and rec.meta["model"] == "MLP"
    assert rec.totals["flops"]["total"] == 3 * 2 * 4 * (8 * 16 + 16 * 4) - 2 * 4 * 8 * 16   # 3584
    assert "torch.compile ((root); 1 call(s) of compiled code): the traced step ran eagerly" in t.report()


def test_a_trace_between_compiled_steps_triggers_no_recompile():
    model, cnt = _mlp(), CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    step, opt = _step(compiled, model, X)
    step()
    assert cnt.frame_count == 1
    graphs = counters["stats"]["unique_graphs"]
    with torchledger.trace(compiled, opt):
        step()
    for _ in range(2):
        step()
    assert cnt.frame_count == 1 and counters["stats"]["unique_graphs"] == graphs
    assert not counters["recompiles"]


def test_ledger_with_compile_in_place_keeps_untraced_steps_compiled():
    model, cnt = _mlp(), CompileCounter()
    model.compile(backend=cnt)                   # module.compile(): compiled in place
    step, opt = _step(model, model, X)
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=3)
    for _ in range(6):                           # steps 0 and 3 traced
        with ledger.step():
            step()
    assert cnt.frame_count == 1 and len(ledger.records) == 2
    assert all(r.meta["compiled"]["modules"] == ["(root)"] for r in ledger.records)


def test_compiled_function_is_counted_and_still_compiles_after():
    model, cnt = _mlp(), CompileCounter()

    @torch.compile(backend=cnt)
    def head(y):
        return torch.nn.functional.gelu(y) * 2

    step, opt = _step(lambda x: head(model(x)), model, X)
    with torchledger.trace(model, opt) as t:
        step()
    assert t.record.meta["compiled"]["modules"] == [] and t.record.meta["compiled"]["calls"] == 1
    assert "torch.compile (compiled functions; 1 call(s)" in t.report()
    step()
    assert cnt.frame_count == 1


def test_uncompiled_model_has_no_compiled_note_and_no_torch_warning():
    model = _mlp()
    step, opt = _step(model, model, X)
    with torchledger.trace(model, opt) as t:
        step()
    assert "compiled" not in t.record.meta and "torch.compile" not in t.report()
    compiled = torch.compile(model, backend=CompileCounter())
    step, opt = _step(compiled, model, X)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torchledger.trace(compiled, opt):
            step()
    assert not [w for w in seen if "global hooks" in str(w.message)]


def test_autocast_compute_dtype_in_header_and_notes():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchledger.trace(model, opt) as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(X)
        y.float().sum().backward()
        opt.step()
    assert t.record.meta["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    text = t.report()
    assert text.splitlines()[0].startswith("torchledger step report: MLP on cpu "
                                           "(float32 weights, bfloat16 compute under autocast)")
    assert "autocast: the step computes in bfloat16 (cpu autocast); parameters, gradients and " \
           "optimizer state stay float32" in text
    from torchledger.render import render
    assert "dtype float32 weights, bfloat16 compute under autocast" in render(t.record, [], "markdown")


SLOW_COMPILE = """
    import time, torch, torchledger

    def slow_backend(gm, example_inputs):       # compiling costs a second, running nothing
        time.sleep(1.0)
        return gm.forward

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
        def forward(self, x):
            return self.fc(x).relu()

    def audit_spec():
        return torchledger.AuditSpec(torch.compile(MLP(), backend=slow_backend), torch.randn(2, 4))
"""


def test_cpu_audit_of_a_compiled_model_times_compiled_steps_not_the_compile(tmp_path):
    import textwrap

    from torchledger.audit.engine import run_audit
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(SLOW_COMPILE))
    run = run_audit(str(path), device="cpu", steps=1, timing_steps=2)
    assert run.record.meta["compiled"]["modules"] == ["(root)"]
    assert len(run.untraced_seconds) == 2
    assert max(run.untraced_seconds) < 0.5      # the 1 s compile ran before the timed steps
