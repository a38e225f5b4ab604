"""Selective activation checkpointing: the outputs its policy keeps are activations (issue 31
item 6). torchtitan's default recipe keeps them in PyTorch's selective-checkpoint storage, where
no saved-tensor hook sees them; the tracer reads the policy's decision for each op."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchledger
from torchledger.tracer.selective import saved_by_policy

MM = torch.ops.aten.mm.default


def mm_only(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64, bias=False)
        self.b = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Model(nn.Module):
    def __init__(self, mode: str, policy=mm_only):
        super().__init__()
        self.block, self.mode, self.policy = Block(), mode, policy

    def forward(self, x):
        if self.mode == "none":
            y = self.block(x)
        elif self.mode == "full":
            y = checkpoint(self.block, x, use_reentrant=False)
        else:
            y = checkpoint(self.block, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, self.policy))
        return y.sum()


# x: 8 x 32 fp32 = 1,024 B (kept by the checkpoint, and by a's matmul without one);
# a's output 8 x 64 = 2,048 B; b's output 8 x 32 = 1,024 B; relu's output 2,048 B.
BY_HAND = {
    "none": 1024 + 2048,              # x (a's mm) and relu's output (relu, b's mm)
    "full": 1024,                     # x alone
    "selective": 1024 + 2048 + 1024,  # x and both mm outputs, kept by the policy
}


def _traced(mode, policy=mm_only):
    torch.manual_seed(0)
    model = Model(mode, policy)
    with torchledger.trace(model) as t:
        model(torch.randn(8, 32)).backward()
    return t.record


def _memtracker(mode):
    """PyTorch's MemTracker on the same step: what is alive when forward ends (before backward)
    and the step's peak."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model, x = Model(mode), torch.randn(8, 32)
    mt = mem_tracker.MemTracker()
    mt.track_external(model, x)
    with mt:
        loss = model(x)
        now = mt.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    act = next(v for k, v in now.items() if getattr(k, "name", None) == "ACT")
    return act, mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("mode", list(BY_HAND))
def test_activation_bytes_by_hand(mode):
    rec = _traced(mode)
    assert rec.totals["activation_bytes"] == BY_HAND[mode]
    block = next(m for m in rec.modules if m["name"] == "block")
    assert block["activation_bytes"] == BY_HAND[mode] - (1024 if mode != "none" else 0)   # x is the model's


@pytest.mark.parametrize("mode", list(BY_HAND))
def test_against_memtracker(mode):
    """MemTracker's activations alive when forward ends are the loss (4 B) and what backward
    needs, x aside: it counts the input as "other" (made outside the step), the tracer as an
    activation once something keeps it."""
    act, peak = _memtracker(mode)
    rec = _traced(mode)
    assert rec.totals["activation_bytes"] == act - 4 + 1024
    assert rec.totals["peak_bytes"] == peak


def test_the_policy_decides():
    """Keep a's output only (the first mm): 2,048 B where both mm outputs were 3,072. The
    recomputation reruns relu from it and stops there (early stop: b's output is needed by no
    backward), so no matmul reruns."""
    seen = []

    def first_mm(ctx, op, *args, **kwargs):
        if op is MM:
            seen.append(op)
            return CheckpointPolicy.PREFER_SAVE if len(seen) == 1 else CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE
    rec = _traced("selective", first_mm)
    assert rec.totals["activation_bytes"] == 1024 + 2048
    assert rec.totals["hardware_flops"] == rec.totals["flops"]["total"]


def test_boolean_policies_and_the_others():
    assert saved_by_policy(True) and not saved_by_policy(False)
    assert saved_by_policy(CheckpointPolicy.MUST_SAVE) and saved_by_policy(CheckpointPolicy.PREFER_SAVE)
    assert not saved_by_policy(CheckpointPolicy.MUST_RECOMPUTE)
    assert not saved_by_policy(CheckpointPolicy.PREFER_RECOMPUTE)


def test_outside_a_trace_the_mode_is_untouched():
    from torch.utils import checkpoint as ckpt
    before = ckpt._CachingTorchDispatchMode.__torch_dispatch__
    _traced("selective")
    assert ckpt._CachingTorchDispatchMode.__torch_dispatch__ is before
