"""The Lightning callback, on a real ``Trainer(max_steps=...)`` (CPU, a tiny LightningModule).

Each traced step is checked against a plain ``torchledger.trace()`` of the same step built by
hand: the same initial weights, the micro-batches the module saw, the same optimizer.
"""
from __future__ import annotations

import csv
import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

L = pytest.importorskip("lightning")
try:    # imported first, so the callback is a pytorch_lightning Callback too
    import pytorch_lightning as PL
except ImportError:  # pragma: no cover - comes with lightning
    PL = None

from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import torchledger  # noqa: E402
from torchledger.integrations.lightning import LedgerCallback  # noqa: E402

from conftest import hook_state  # noqa: E402

V, D, T, B = 128, 32, 8, 2      # vocab, width, sequence length, micro-batch size


class Tiny(L.LightningModule):
    """Embedding -> MLP (optionally checkpointed) -> LM head; next-token cross-entropy."""

    def __init__(self, checkpointing=False, freeze=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.body = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, V, bias=False)
        self.checkpointing = checkpointing
        if freeze:          # PEFT-style: the MLP's first layer frozen by hand
            self.body[0].requires_grad_(False)
        self.seen, self.losses = [], []

    def forward(self, x):
        h = self.emb(x)
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=False)
        else:
            h = self.body(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _loader(n=16):
    ids = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=B, shuffle=False)


def _fit(out, callback=None, *, steps=2, accumulate=2, precision="32-true", **module_kw):
    module = Tiny(**module_kw)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=CSVLogger(str(out)),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate, precision=precision, log_every_n_steps=1,
                        callbacks=[callback] if callback else None)
    trainer.fit(module, _loader())
    return trainer, module


def _hand_trace(micro_batches, *, bf16=False, **module_kw):
    """Lightning's step written out: each micro-batch's loss / k backward, optimizer step."""
    module = Tiny(**module_kw)
    opt = module.configure_optimizers()
    tokens = sum(x.numel() for x, _ in micro_batches)
    with torchledger.trace(module, opt, tokens=tokens) as t:
        opt.zero_grad()
        for i, batch in enumerate(micro_batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = module.training_step(batch, i)
            (loss / len(micro_batches)).backward()
        opt.step()
    return t.record


SAME = ("params", "param_bytes", "grad_bytes", "optimizer_state_bytes", "tokens", "hardware_flops")


@pytest.mark.parametrize("case", ["accumulation", "bf16-mixed", "checkpointing+frozen"])
def test_traced_step_matches_a_hand_trace(tmp_path, case):
    module_kw = {"checkpointing": case.startswith("checkpointing"), "freeze": case.endswith("frozen")}
    bf16 = case == "bf16-mixed"
    cb = LedgerCallback(sample_every=2)
    trainer, module = _fit(tmp_path, cb, precision="bf16-mixed" if bf16 else "32-true", **module_kw)
    assert trainer.global_step == 2 and len(cb.ledger.records) == 1     # step 1 traced, 2 timed
    got = cb.ledger.records[0].totals
    want = _hand_trace(module.seen[:2], bf16=bf16, **module_kw).totals
    assert got["flops"] == want["flops"]
    for key in SAME:
        assert got[key] == want[key], key
    assert got["tokens"] == 2 * B * T == 32            # 2 micro-batches of 2 x 8 token ids
    assert got["tokens_source"] == "batch[0].numel() summed over 2 micro-batches (Lightning)"
    # matmul params: MLP 32*128 + 128*32 = 8,192, head 128*32 = 4,096 -> N = 12,288;
    # forward = 2 * N * 32 tokens = 786,432 (the last micro-batch's runs inside
    # optimizer.step(closure) and still counts as forward)
    assert got["flops"]["forward"] == 786_432 and got["flops"]["optimizer"] == 0
    # backward = 2 x forward (the embedding output needs grad), less body[0]'s weight grad
    # (2 * 4,096 * 32 = 262,144) when it is frozen
    assert got["flops"]["backward"] == 2 * 786_432 - (262_144 if module_kw["freeze"] else 0)
    if module_kw["freeze"]:
        trainable = [p for p in Tiny(freeze=True).parameters() if p.requires_grad]
        assert got["grad_bytes"] == 4 * sum(p.numel() for p in trainable)
        # AdamW: exp_avg + exp_avg_sq in fp32, and one fp32 scalar step per tensor
        assert got["optimizer_state_bytes"] == 8 * sum(p.numel() for p in trainable) + 4 * len(trainable)
    if module_kw["checkpointing"]:
        # the recompute: non-reentrant checkpoint stops once the tensors backward needs are
        # back (body[2]'s input), so only body[0]'s matmul reruns: 2 * 4,096 * 32 = 262,144
        assert got["hardware_flops"] == got["flops"]["total"] + 262_144


def test_files_logs_mfu_and_nothing_left_installed(tmp_path):
    before = hook_state()
    cb = LedgerCallback(sample_every=2, peak_flops=1e12)
    trainer, module = _fit(tmp_path, cb, steps=3)
    assert hook_state() == before
    assert not module._forward_pre_hooks and not module._forward_hooks
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in module.parameters())
    out = os.path.join(trainer.log_dir, "torchledger")
    assert sorted(os.listdir(out)) == ["report.txt", "step_000001.json", "step_000003.json"]
    for name, record in zip(["step_000001.json", "step_000003.json"], cb.ledger.records):
        with open(os.path.join(out, name)) as f:
            loaded = torchledger.StepRecord.from_json(f.read())
        assert loaded.totals["flops"] == record.totals["flops"]
    with open(os.path.join(out, "report.txt")) as f:
        assert f.read().startswith("torchledger step report: Tiny")
    # what the logger got: one row per traced step, at the steps Lightning logged them
    with open(os.path.join(trainer.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("torchledger/flops")]
    # steps 1 and 3, at the rows of their own metrics (Lightning counts them from 0)
    assert [r["step"] for r in rows] == ["0", "2"]
    for row, record in zip(rows, cb.ledger.records):
        t = record.totals
        assert float(row["torchledger/flops_per_token"]) == pytest.approx(t["flops"]["total"] / 32)
        assert float(row["torchledger/peak_bytes"]) == t["peak_bytes"] > 0
        assert float(row["torchledger/mfu"]) == pytest.approx(t["mfu"])
    # step 3's MFU uses the untraced step 2's time: flops / seconds / peak
    t, seconds = cb.ledger.records[-1].totals, cb.ledger.untraced_seconds[0]
    assert t["mfu"] == pytest.approx(t["flops"]["total"] / seconds / 1e12)


def test_training_unchanged_by_the_callback(tmp_path):
    runs = []
    for cb in (None, LedgerCallback(sample_every=1, write=False)):
        trainer, module = _fit(tmp_path / str(cb is None), cb, steps=2)
        runs.append((module.losses, [p.detach().clone() for p in module.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert len(l0) == 4 and all(torch.equal(a, b) for a, b in zip(l0, l1))   # bitwise
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert not os.path.exists(os.path.join(trainer.log_dir, "torchledger"))     # write=False


@pytest.mark.parametrize("where", ["open", "_tokens_of_step"])
def test_an_error_disables_the_callback_and_training_goes_on(tmp_path, monkeypatch, where):
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
        trainer, _ = _fit(tmp_path, cb, steps=2)
    assert trainer.global_step == 2 and hook_state() == before
    said = [str(w.message) for w in caught if "torchledger" in str(w.message)]
    event = "on_train_batch_start" if where == "open" else "on_train_batch_end"
    assert len(said) == 1 and f"LedgerCallback.{event} raised RuntimeError: boom" in said[0]
    assert cb.written == []


def test_an_exception_out_of_fit_closes_the_step(tmp_path):
    class Fails(Tiny):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:          # the second micro-batch of the first (traced) step
                raise ValueError("bad batch")
            return super().training_step(batch, batch_idx)
    before = hook_state()
    cb = LedgerCallback(sample_every=1)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                        default_root_dir=str(tmp_path), callbacks=[cb])
    with pytest.raises(ValueError, match="bad batch"):
        trainer.fit(Fails(), _loader())
    assert hook_state() == before
    assert "partial step: training raised ValueError" in cb.ledger.records[-1].warnings
    assert cb.written == []


@pytest.mark.skipif(PL is None, reason="pytorch_lightning not installed")
def test_pytorch_lightning_trainer(tmp_path):
    """The same callback in a ``pytorch_lightning.Trainer`` (the package's older name)."""
    class Legacy(PL.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    cb = LedgerCallback(sample_every=1)
    trainer = PL.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[cb])
    trainer.fit(Legacy(), _loader())
    # one micro-batch of 2 x 8 tokens; the head only multiplies: forward 2*(32*128)*16 = 131,072
    assert cb.ledger.records[0].totals["flops"]["forward"] == 131_072
    assert cb.ledger.records[0].totals["tokens"] == 16
    assert sorted(os.listdir(tmp_path / "torchledger")) == ["report.txt", "step_000001.json"]
