"""The same step gives the same record: storages are known by their lifetime, not by an
address that a freed storage hands on to the next one (issue 20, item 2).

A storage's ``_cdata`` (its C++ address) is reused by the next storage allocated after it is
freed: a record keyed by address mistakes a new activation for the dead bf16 copy of a bias
(N grows by the bias) or for a dead ``contiguous()`` copy (TL-COPY-003 "permuted back" fires on
a tensor that was never copied). Each test below makes the reuse happen on purpose.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import torchledger


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (spinning threads on a shared machine only cost time)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _reuse(addr: int, shape, keep: list):
    """A new tensor whose storage sits at ``addr`` (a storage freed just before); the
    allocator hands the freed slot to the next storage of its size class."""
    for _ in range(200):
        t = torch.randn(*shape)
        if t.untyped_storage()._cdata == addr:
            return t
        keep.append(t)                  # held: the next allocation cannot reuse this one's slot
    pytest.skip("the allocator did not reuse the freed storage's address")


def test_new_tensor_at_a_dead_weight_copys_address_is_not_a_weight():
    torch.manual_seed(0)
    head = nn.Linear(8, 3)
    keep: list = []
    with torchledger.trace(head) as t:
        cast = head.bias.to(torch.bfloat16)          # a copy of a parameter (what autocast makes)
        addr = cast.untyped_storage()._cdata
        del cast                                     # freed: its address is free for the next storage
        x = _reuse(addr, (4, 8), keep)               # an input, not a parameter
        head(x).sum().backward()
    # N counts the weights a matmul multiplies: head.weight only, 8*3 = 24 (the bias is added,
    # and x, born where the bias's copy died, is an input)
    assert t.record.totals["matmul_params"] == 24


def test_new_tensor_at_a_dead_contiguous_copys_address_was_not_copied():
    keep: list = []
    w = torch.randn(8, 4, requires_grad=True)
    with torchledger.trace(nn.Linear(2, 2)) as t:
        a = torch.randn(4, 8, requires_grad=True)
        c = a.transpose(0, 1).contiguous()           # a copy of a (8, 4) view with strides (1, 8)
        addr = c.untyped_storage()._cdata
        del c
        y = _reuse(addr, (8, 4), keep).requires_grad_()   # never copied
        z = y.transpose(0, 1) @ w                    # its transpose has the dims order c's source had
        z.sum().backward()
    copies = t.record.copies
    assert [c["reason"] for c in copies] == ["contiguous of non-contiguous"]
    assert not any(c.get("permuted_back") for c in copies)
    assert "TL-COPY-003" not in {f.rule for f in t.findings()}


def _micro_batched(model, opt, x, steps: int, autocast: bool) -> collections.Counter:
    """N of ``steps`` identical traced steps of 4 micro-batches each."""
    seen = collections.Counter()
    for _ in range(steps):
        with torchledger.trace(model, optimizer=opt) as t:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = model(x)
                y.float().sum().backward()
            opt.step()
            opt.zero_grad()
        seen[t.record.totals["matmul_params"]] += 1
    return seen


def test_identical_bf16_micro_batched_steps_give_one_n():
    # autocast caches its bf16 copies of the weights and biases until its block ends; the next
    # micro-batch's activations are born at their addresses (before the fix 8 of 20 steps read
    # N + 32, a bias)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    # 16*32 + 32*32 + 32*4 = 1664 weights multiplied; biases added, not multiplied
    assert _micro_batched(model, opt, x, 12, autocast=True) == {1664: 12}
    assert _micro_batched(model, opt, x, 2, autocast=False) == {1664: 2}


def test_hf_gpt_neox_bf16_micro_batches_same_record_every_step():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, rotary_pct=0.25, attn_implementation="sdpa",
                           use_cache=False)
    model = tf.GPTNeoXForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (2, 32))
    ns, copy3 = collections.Counter(), 0
    for _ in range(5):
        with torchledger.trace(model, optimizer=opt, tokens=4 * 64) as t:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
        ns[t.record.totals["matmul_params"]] += 1
        copy3 += "TL-COPY-003" in {f.rule for f in t.record.findings}
    # per layer: qkv 64*192 + dense 64*64 + MLP 2*64*256 = 49,152; 2 layers + embed_out 64*256
    # = 98,304 + 16,384 = 114,688 (the fp32 figure; the bf16 copies are the same weights)
    assert ns == {114_688: 5}
    assert copy3 == 0
