"""The Hugging Face ``Trainer`` callback, on a real ``Trainer`` (CPU, a tiny GPT-2 from a config).

Each traced step is checked against a plain ``torchledger.trace()`` of the same step built
by hand: the same initial weights, the Trainer's own micro-batches, the same optimizer class.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import torchledger  # noqa: E402
from torchledger.integrations.hf import LedgerCallback  # noqa: E402

from conftest import hook_state  # noqa: E402

V, T, B = 128, 8, 2     # vocab, sequence length, micro-batch size


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        self.x = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _model(freeze=False):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    if freeze:              # PEFT-style: block 0 and the position embeddings frozen by hand
        model.transformer.h[0].requires_grad_(False)
        model.transformer.wpe.requires_grad_(False)
    return model


#: transformers 5 renamed gradient_checkpointing (the old name warns)
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                 else "gradient_checkpointing")


def _args(out, *, ga=2, steps=2, bf16=False, checkpointing=False):
    return TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no",
                             logging_steps=1, max_steps=steps, per_device_train_batch_size=B,
                             gradient_accumulation_steps=ga, bf16=bf16, **{CHECKPOINTING: checkpointing},
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)


def _train(out, callback=None, *, freeze=False, **kw):
    """Train; returns (trainer, model, the micro-batches the model saw in training)."""
    model, seen = _model(freeze), []

    def capture(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            seen.append({k: kwargs[k].clone() for k in ("input_ids", "labels")})
    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    trainer = Trainer(model=model, args=_args(out, **kw), train_dataset=_Tokens(),
                      callbacks=[callback] if callback else None)
    trainer.train()
    handle.remove()
    return trainer, model, seen


def _hand_trace(args, micro_batches, *, freeze=False):
    """The Trainer's step written out: forward + backward per micro-batch (loss / micro-batches),
    clip to max_grad_norm, optimizer step, zero_grad; same weights, batches and optimizer."""
    model = _model(freeze)
    if getattr(args, CHECKPOINTING):
        enable = getattr(model, CHECKPOINTING + "_enable")
        enable(**{CHECKPOINTING + "_kwargs": getattr(args, CHECKPOINTING + "_kwargs")})
    model.train()
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    tokens = sum(mb["input_ids"].numel() for mb in micro_batches)
    with torchledger.trace(model, opt, tokens=tokens) as t:
        for mb in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(**mb).loss
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        model.zero_grad()
    return t.record


SAME = ("params", "param_bytes", "grad_bytes", "optimizer_state_bytes", "tokens", "hardware_flops")


@pytest.mark.parametrize("case", ["accumulation", "bf16", "checkpointing+frozen"])
def test_traced_step_matches_a_hand_trace(tmp_path, case):
    kw = {"bf16": case == "bf16", "checkpointing": case.startswith("checkpointing")}
    freeze = case.endswith("frozen")
    cb = LedgerCallback(sample_every=2)
    trainer, _, seen = _train(tmp_path, cb, freeze=freeze, **kw)
    assert len(cb.ledger.records) == 1                  # steps 1 and 2, one in two traced
    got = cb.ledger.records[0].totals
    hand = _hand_trace(trainer.args, seen[:2], freeze=freeze)
    want = hand.totals
    # Trainer(bf16=True) on CPU: accelerate enters autocast inside model.forward, the hand
    # step around it; both records say the step computed in bf16
    cast = {"device_type": "cpu", "dtype": "bfloat16"} if kw["bf16"] else None
    assert cb.ledger.records[0].meta.get("autocast") == hand.meta.get("autocast") == cast
    assert got["flops"] == want["flops"]
    for key in SAME:
        assert got[key] == want[key], key
    # NB: the Trainer has the model divide the loss by the label count (num_items_in_batch)
    # where the hand step divides by 2: a few scalar bytes apart, nothing more
    assert got["activation_bytes"] == pytest.approx(want["activation_bytes"], abs=64)
    assert got["tokens"] == 2 * B * T == 32             # 2 micro-batches of 2 x 8 token ids
    assert got["tokens_source"] == "input_ids.numel() summed over 2 micro-batches (Hugging Face Trainer)"
    # GPT-2, d=32, 2 layers: matmul params per layer 32*96 + 32*32 + 2*32*128 = 12,288; LM head
    # 128*32 = 4,096 -> N = 2*12,288 + 4,096 = 28,672. Attention per layer and micro-batch:
    # QK^T and AV, 2 * (2*B*h*T*T*d_h) = 2 * (2*2*2*8*8*16) = 16,384.
    # forward = 2*N*32 tokens + 2 layers * 2 micro-batches * 16,384 = 1,835,008 + 65,536
    assert got["flops"]["forward"] == 1_900_544
    # backward = 2 x forward, less block 0's weight grads when it is frozen (2 * 12,288 * 32)
    assert got["flops"]["backward"] == 2 * 1_900_544 - (786_432 if freeze else 0)
    if freeze:
        trainable = sum(p.numel() for p in _model(True).parameters() if p.requires_grad)
        tensors = sum(1 for p in _model(True).parameters() if p.requires_grad)
        assert got["grad_bytes"] == 4 * trainable
        # AdamW: exp_avg + exp_avg_sq in fp32, and one fp32 scalar step per tensor
        assert got["optimizer_state_bytes"] == 8 * trainable + 4 * tensors
    if kw["checkpointing"]:
        assert got["hardware_flops"] > got["flops"]["total"]    # the recomputed forward


def test_files_logs_mfu_and_nothing_left_installed(tmp_path):
    before = hook_state()
    cb = LedgerCallback(sample_every=2, peak_flops=1e12)
    trainer, model, _ = _train(tmp_path, cb, steps=3)
    assert hook_state() == before
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    out = tmp_path / "torchledger"
    assert sorted(os.listdir(out)) == ["report.txt", "step_000001.json", "step_000003.json"]
    for name, record in zip(["step_000001.json", "step_000003.json"], cb.ledger.records):
        loaded = torchledger.StepRecord.from_json((out / name).read_text())
        assert loaded.totals["flops"] == record.totals["flops"]
        assert json.loads((out / name).read_text())["totals"]["tokens"] == 32
    assert (out / "report.txt").read_text().startswith("torchledger step report: GPT2LMHeadModel")
    logged = [h for h in trainer.state.log_history if "torchledger/flops" in h]
    assert [h["step"] for h in logged] == [1, 3]
    for h, record in zip(logged, cb.ledger.records):
        t = record.totals
        assert h["torchledger/flops_per_token"] == t["flops"]["total"] / 32
        assert h["torchledger/peak_bytes"] == t["peak_bytes"] > 0
        assert h["torchledger/mfu"] == t["mfu"]
    # step 3's MFU uses the untraced step 2's time: flops / seconds / peak
    t, seconds = cb.ledger.records[-1].totals, cb.ledger.untraced_seconds[0]
    assert logged[-1]["torchledger/mfu"] == pytest.approx(t["flops"]["total"] / seconds / 1e12)


def test_training_unchanged_by_the_callback(tmp_path):
    runs = []
    for cb in (None, LedgerCallback(sample_every=1, write=False)):
        trainer, model, _ = _train(tmp_path / str(cb is None), cb, steps=2)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert len(l0) == 2 and l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))      # bitwise
    assert not (tmp_path / "False" / "torchledger").exists()   # write=False


@pytest.mark.parametrize("where", ["open", "add_micro_batch", "_tokens_of_step"])
def test_an_error_disables_the_callback_and_training_goes_on(tmp_path, monkeypatch, where):
    """An error with the step's tracer installed (after ``open``) or while closing it: one
    warning, the tracer removed, training completes, nothing more traced or written."""
    from torchledger.integrations import _common
    original = getattr(_common.LedgerRun, where)

    def broken(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise RuntimeError("boom")
    monkeypatch.setattr(_common.LedgerRun, where, broken)
    before = hook_state()
    cb = LedgerCallback(sample_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model, _ = _train(tmp_path, cb, steps=2)
    assert trainer.state.global_step == 2
    assert hook_state() == before and not model._forward_pre_hooks
    said = [str(w.message) for w in caught if "torchledger" in str(w.message)]
    if where == "add_micro_batch":      # in the token hook: the tokens are unknown, no more
        assert not said and not cb._run.disabled and len(cb.ledger.records) == 2
        assert "tokens unknown: counting them raised RuntimeError: boom" in cb.ledger.records[0].warnings
        return
    event = "on_step_begin" if where == "open" else "on_step_end"
    assert len(said) == 1 and f"LedgerCallback.{event} raised RuntimeError: boom" in said[0]
    assert cb._run.disabled and len(cb.ledger.records) == 1      # step 1 closed, then nothing
    assert cb.written == [] and not (tmp_path / "torchledger").exists()


def test_tokens_unknown_are_said_not_guessed(tmp_path, monkeypatch):
    from torchledger.integrations import _common

    def fails(batch, key="input_ids"):
        raise ValueError("no ids")
    monkeypatch.setattr(_common, "batch_tokens", fails)
    cb = LedgerCallback(sample_every=2)
    trainer, _, _ = _train(tmp_path, cb, ga=1)
    record = cb.ledger.records[0]
    assert record.totals["tokens"] == 0 and record.totals["tokens_source"] is None
    assert "tokens unknown: counting them raised ValueError: no ids" in record.warnings
    logged = [h for h in trainer.state.log_history if "torchledger/flops" in h]
    assert len(logged) == 1 and "torchledger/flops_per_token" not in logged[0]


# -- an exception out of trainer.train() in the middle of a traced step ---------------------------
class _Fault(TrainerCallback):
    """Raises ``error`` before the optimizer step of step 2 (outside ``training_step``)."""

    def __init__(self, error):
        self.error = error

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise self.error


class _EmptyAfter(_Tokens):
    """The first ``n`` items, then empty ones: HF's "The batch received was empty"."""

    def __init__(self, n):
        super().__init__()
        self.n, self.served = n, 0

    def __getitem__(self, i):
        self.served += 1
        return super().__getitem__(i) if self.served <= self.n else {}


def _failing_trainer(out, fault, cb, *, late=False):
    """A 2-step Trainer (one micro-batch a step) whose step 2 fails with ``fault``."""
    model, data, callbacks = _model(), _Tokens(), [cb]
    if fault == "RuntimeError in forward":
        calls = []

        def boom(module, args, kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom in forward")
        model.register_forward_pre_hook(boom, with_kwargs=True)
    elif fault == "KeyboardInterrupt before the optimizer step":
        callbacks.append(_Fault(KeyboardInterrupt()))
    elif fault == "empty batch":
        data = _EmptyAfter(B)
    trainer = Trainer(model=model, args=_args(out, ga=1, steps=2), train_dataset=data,
                      callbacks=None if late else callbacks)
    if late:                 # added after __init__: no on_init_end for it
        for c in callbacks:
            trainer.add_callback(c)
    return trainer, model


FAULTS = {"RuntimeError in forward": (RuntimeError, "boom in forward"),
          "KeyboardInterrupt before the optimizer step": (KeyboardInterrupt, None),
          "empty batch": (ValueError, "The batch received was empty")}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_exception_mid_step_leaves_nothing_installed(tmp_path, fault):
    """Step 1 traced and written; step 2 fails in the middle: the exception reaches the caller
    unchanged, the tracer is gone (hooks, mode, SDPA patch, lock), the failed step's record is
    kept and marked, no file for it, and a new trace() works at once."""
    before = hook_state()
    cb = LedgerCallback(sample_every=1)
    trainer, model = _failing_trainer(tmp_path, fault, cb)
    error, text = FAULTS[fault]
    with pytest.raises(error, match=text):
        trainer.train()
    assert hook_state() == before
    assert not model._forward_pre_hooks or fault == "RuntimeError in forward"   # the test's own hook
    assert not cb._run.is_open and cb._run.disabled is False
    assert cb.written == [str(tmp_path / "torchledger" / "step_000001.json")]
    first, failed = cb.ledger.records
    assert not first.meta["failed"] and failed.meta["failed"]
    assert (f"partial step: trainer.train() raised {error.__name__} in the middle of this optimizer step"
            in failed.warnings)
    model._forward_pre_hooks.clear()
    with torchledger.trace(model) as t:           # was: "a torchledger trace is already active"
        model(torch.zeros(1, T, dtype=torch.long)).logits.sum().backward()
    assert t.record.totals["flops"]["total"] > 0


def test_added_late_it_closes_the_step_on_the_next_event_or_with_the_trainer(tmp_path):
    """With add_callback() the first train() is not guarded: an exception in the forward is
    caught by the wrapped training_step; one outside it (before the optimizer step) leaves the
    step open until the next train() begins, or until the Trainer is collected."""
    import gc
    before = hook_state()
    cb = LedgerCallback(sample_every=1, write=False)
    trainer, model = _failing_trainer(tmp_path, "RuntimeError in forward", cb, late=True)
    with pytest.raises(RuntimeError, match="boom in forward"):
        trainer.train()
    assert hook_state() == before and "training_step" not in trainer.__dict__
    assert "partial step: training_step raised RuntimeError" in cb.ledger.records[-1].warnings[-1]

    cb = LedgerCallback(sample_every=1, write=False)
    trainer, model = _failing_trainer(tmp_path, "KeyboardInterrupt before the optimizer step", cb, late=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert hook_state()["active"] and cb._run.is_open          # outside training_step: still open
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if not isinstance(c, _Fault)]
    trainer.args.max_steps = 1
    trainer.train()                # the same trainer again: on_train_begin closes the open step
    assert hook_state() == before
    assert any(w.startswith("partial step: closed when the next train() began") for w in
               cb.ledger.records[-2].warnings)

    cb = LedgerCallback(sample_every=1, write=False)
    trainer, model = _failing_trainer(tmp_path, "KeyboardInterrupt before the optimizer step", cb, late=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert hook_state()["active"]
    del trainer
    gc.collect()
    assert hook_state() == before
    assert ("partial step: the Trainer was garbage-collected with this optimizer step open"
            in cb.ledger.records[-1].warnings)


def test_a_step_left_open_is_closed_at_interpreter_exit():
    """Nothing else closing it, the step is closed by the exit handler ``_common`` registers
    (``_close_at_exit``, called here; the next test checks that exit calls it)."""
    from torchledger.integrations import _common
    before = hook_state()
    model = torch.nn.Linear(2, 2)
    run = _common.LedgerRun("test", sample_every=1)
    run.begin(model, None)
    run.open(1)
    model(torch.ones(1, 2))
    assert hook_state()["active"] and run in _common._OPEN
    _common._close_at_exit()
    assert hook_state() == before and not _common._OPEN
    record, = run.ledger.records
    assert record.meta["failed"] is False and record.totals["flops"]["forward"] == 2 * 1 * 2 * 2   # 8
    assert record.warnings[-1] == "partial step: the interpreter exited before this optimizer step ended"


def test_the_exit_handler_is_registered(tmp_path):
    """A process that exits with a step open runs ``_close_at_exit`` (a stand-in step, so the
    subprocess needs no torch: ``_common`` imports it only when a step is made)."""
    import subprocess
    import sys
    script = tmp_path / "left_open.py"
    script.write_text(
        "import sys\n"
        "from torchledger.integrations import _common\n"
        "class Step:\n"
        "    def __exit__(self, *exc):\n"
        "        print('closed', exc == (None, None, None), flush=True)\n"
        "run = _common.LedgerRun('test')\n"
        "run._step = (Step(), None, 1)\n"
        "_common._OPEN.add(run)\n"
        "print('torch imported:', 'torch' in sys.modules, flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["torch imported: False", "closed True"]
