"""A fake step observed from inside its FakeTensorMode (``LedgerMode.attach``) gives the same
record as one observed by a dispatch mode pushed above it, and leaves the fake mode as it was.

Attached, each op crosses into Python once (the fake mode's own ``dispatch``, wrapped for the
step) instead of twice; the tracer attaches only where it sees the same ops either way (the
fake mode is the only dispatch mode, no DTensor parameters, no process group).
"""
from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import torchledger
from torchledger.models import build_model, example_inputs
from torchledger.tracer.step import StepTracer


def _timeless(d):
    """A record's dict without what is measured by the clock."""
    d = json.loads(json.dumps(d))
    for section in ("meta", "totals"):
        for k in [k for k in d.get(section, {}) if "seconds" in k or k in ("step_timing", "created")]:
            d[section].pop(k)
    return d


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False)
        return self.b(h).softmax(-1).sum()


def _steps(model_fn, attach: bool, seen: list):
    with FakeTensorMode() as fm:
        model, inputs = model_fn()
        opt = torch.optim.AdamW(model.parameters())

        def step():
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            seen.append(("dispatch" in vars(fm), torch._C._len_torch_dispatch_stack()))
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()                                    # optimizer state exists from here on
        StepTracer.attach_fake = attach
        try:
            with torchledger.trace(model, optimizer=opt, tokens=64) as t:
                step()
        finally:
            StepTracer.attach_fake = True
        assert "dispatch" not in vars(fm)         # the fake mode is as it was
    return t


def _gpt():
    model = build_model("gpt2-tiny")
    return model, example_inputs("gpt2-tiny", batch=2, seq_len=32)


def _llama():
    model = build_model("llama-tiny")
    return model, example_inputs("llama-tiny", batch=2, seq_len=32)


def _ckpt():
    return _Checkpointed(), torch.randn(8, 16)


class _Scaled(torch.autograd.Function):
    """A custom autograd Function that saves its input and its output."""

    @staticmethod
    def forward(ctx, x):
        y = x * 3
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * 3 + 0 * (x + y)


class _Mixed(nn.Module):
    """A custom Function, SDPA's math path through a reference bound before the trace (found
    by its softmax), and a bf16 autocast region."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = self.qkv(_Scaled.apply(x)).view(2, 4, 3, 2, 8).unbind(2)
        with sdpa_kernel(SDPBackend.MATH):
            a = _SDPA(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.out(a.transpose(1, 2).reshape(2, 4, 16))
        return h.float().pow(2).mean()


_SDPA = torch.nn.functional.scaled_dot_product_attention     # bound before any trace


def _mixed():
    return _Mixed(), torch.randn(2, 4, 16)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 16))
    return _LossOf(model), {"input_ids": ids, "labels": ids}


class _LossOf(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).loss


@pytest.mark.parametrize("model_fn", [_gpt, _llama, _ckpt, _mixed, _hf_gpt2],
                         ids=["gpt2-tiny", "llama-tiny", "checkpointed", "function-sdpa-autocast", "hf-gpt2"])
def test_attached_and_pushed_records_are_the_same(model_fn):
    seen_a, seen_p = [], []
    attached = _steps(model_fn, True, seen_a)
    pushed = _steps(model_fn, False, seen_p)
    # the untraced step: nothing attached, the fake mode alone on the stack; traced: attached
    # with no mode pushed, or pushed with two modes on the stack
    assert seen_a == [(False, 1), (True, 1)]
    assert seen_p == [(False, 1), (False, 2)]
    a, p = _timeless(attached.record.to_dict()), _timeless(pushed.record.to_dict())
    assert a["totals"]["flops"]["total"] > 0 and a["memory"]["segments"]
    assert a == p
    assert [(f.rule, f.message) for f in attached.findings()] == [
        (f.rule, f.message) for f in pushed.findings()]


def test_a_mode_above_the_fake_one_is_traced_from_above():
    """A user's mode above the fake mode sees the ops first: the tracer pushes its own mode
    (above both) rather than attach below the user's."""
    from torch.utils.flop_counter import FlopCounterMode
    seen = []
    with FakeTensorMode() as fm:
        model, x = nn.Linear(8, 4), torch.randn(2, 8)
        with FlopCounterMode(display=False):
            with torchledger.trace(model) as t:
                model(x).sum().backward()
                seen.append(("dispatch" in vars(fm), torch._C._len_torch_dispatch_stack()))
    assert seen == [(False, 3)]
    assert t.record.totals["flops"]["forward"] == 2 * 2 * 8 * 4     # 2 x rows x in x out = 128


def test_the_fake_mode_is_restored_when_the_step_raises():
    with FakeTensorMode() as fm:
        model, x = nn.Linear(8, 4), torch.randn(2, 8)
        with pytest.raises(ValueError, match="boom"):
            with torchledger.trace(model):
                model(x).sum().backward()
                assert "dispatch" in vars(fm)
                raise ValueError("boom")
        assert "dispatch" not in vars(fm)
        with torchledger.trace(model) as t:          # and the next trace works at once
            model(x).sum().backward()
    assert t.record.totals["flops"]["forward"] == 128


def test_a_dispatch_the_user_set_on_the_fake_mode_is_left_alone():
    """A fake mode whose ``dispatch`` someone already replaced on the instance is not
    attached to (the tracer pushes its mode), and keeps that replacement."""
    with FakeTensorMode() as fm:
        calls = []
        original = fm.dispatch

        def counting(func, types, args=(), kwargs=None):
            calls.append(func)
            return original(func, types, args, kwargs)
        fm.dispatch = counting
        model, x = nn.Linear(8, 4), torch.randn(2, 8)
        with torchledger.trace(model) as t:
            model(x).sum().backward()
        assert vars(fm)["dispatch"] is counting
        del fm.dispatch
    assert calls and t.record.totals["flops"]["forward"] == 128


def test_ops_of_another_thread_on_the_same_fake_mode_are_not_the_steps():
    with FakeTensorMode() as fm:
        model, x = nn.Linear(8, 4), torch.randn(2, 8)
        done = threading.Event()
        go = threading.Event()

        def other():
            with fm:
                go.wait(10)
                torch.randn(64, 64) @ torch.randn(64, 64)      # 2*64^3 FLOPs, not the step's
            done.set()
        th = threading.Thread(target=other)
        th.start()
        with torchledger.trace(model) as t:
            go.set()
            done.wait(10)
            model(x).sum().backward()
        th.join(10)
    assert t.record.totals["flops"]["forward"] == 128


def test_a_fake_mode_entered_inside_the_step_is_not_the_steps_work():
    """The one difference from a pushed mode (``LedgerMode.attach``): a FakeTensorMode the step
    enters itself takes the fake mode's place, and its ops (on its own fake tensors: shape
    inference) are not recorded; a pushed mode counted them as "other"."""
    other = {}
    for attach in (True, False):
        StepTracer.attach_fake = attach
        try:
            with FakeTensorMode():
                model, x = nn.Linear(8, 4), torch.randn(2, 8)
                with torchledger.trace(model) as t:
                    model(x).sum().backward()
                    with FakeTensorMode():
                        a = torch.randn(64, 64)
                        a @ a
        finally:
            StepTracer.attach_fake = True
        assert t.record.totals["flops"]["total"] == 256    # 2*2*8*4 = 128 forward, as much backward
        other[attach] = t.record.totals["flops"]["other"]
    assert other == {True: 0, False: 2 * 64 ** 3}           # 524,288
