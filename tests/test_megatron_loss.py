"""Megatron's cross-entropy under --kernels te (torchledger/parallel/megatron_loss.py): the same
numbers as PyTorch's, one fp32 buffer a logit instead of PyTorch's log-softmax and its
gradients, swapped in only while a te step runs."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from torchledger.parallel.megatron_loss import LOSS_NOTE, MegatronCrossEntropy, megatron_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_values_and_gradients_are_pytorchs(dtype, reduction):
    torch.manual_seed(0)
    x = torch.randn(9, 13, dtype=dtype, requires_grad=True)
    t = torch.randint(0, 13, (9,))
    t[3] = t[7] = -100                                   # ignored rows: no loss, no gradient
    ref = F.cross_entropy(x.float(), t, reduction=reduction)
    ref.backward()
    want = x.grad.clone()
    x.grad = None
    got = MegatronCrossEntropy.apply(x, t, -100, reduction)
    got.backward()
    assert got.dtype == torch.float32                    # Megatron's loss is fp32
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert x.grad.dtype == dtype
    assert torch.allclose(x.grad.float(), want.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert not x.grad[3].any() and not x.grad[7].any()


def test_swapped_only_inside_and_restored_after_a_raise():
    original = F.cross_entropy
    applied = {}
    with pytest.raises(RuntimeError, match="boom"):
        with megatron_cross_entropy(applied):
            assert F.cross_entropy is not original
            F.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]))
            # what Megatron's does not cover keeps PyTorch's: smoothing, weights, (N, C, d) inputs
            F.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), label_smoothing=0.1)
            F.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), weight=torch.ones(5))
            F.cross_entropy(torch.randn(4, 5, 3), torch.zeros(4, 3, dtype=torch.long))
            raise RuntimeError("boom")
    assert F.cross_entropy is original
    assert applied == {"cross_entropy": 1}


def _llama(vocab=4096):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_a_hugging_face_causal_lm_loses_and_learns_the_same():
    from transformers.loss.loss_utils import LOSS_MAPPING
    model = _llama(vocab=256)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hf = LOSS_MAPPING["ForCausalLM"]
    applied = {}
    with megatron_cross_entropy(applied):
        got = model(input_ids=ids, labels=ids).loss
        got.backward()
    assert LOSS_MAPPING["ForCausalLM"] is hf
    assert applied == {"cross_entropy": 1}
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-6), n


def _audit(tmp_path, kernels):
    pytest.importorskip("transformers")
    path = tmp_path / "llama_tiny.py"
    path.write_text(
        "import torch, torchledger\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def audit_spec():\n"
        "    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)\n"
        "    ids = torch.randint(0, 4096, (2, 64))\n"
        "    return torchledger.AuditSpec(LlamaForCausalLM(cfg), {'input_ids': ids, 'labels': ids})\n")
    from click.testing import CliRunner
    from torchledger.cli import cli
    out = tmp_path / f"{kernels}.json"
    res = CliRunner().invoke(cli, ["audit", str(path), "--gpu", "h100", "--precision", "bf16-mixed", "--kernels",
                                   kernels, "--format", "json", "--output", str(out), "--fail-on", "never"])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_the_head_holds_one_fp32_buffer_a_logit_under_te(tmp_path):
    eager, te = _audit(tmp_path, "eager"), _audit(tmp_path, "te")
    logits = 2 * 64 * 4096                     # transformers' loss over every position (labels padded)
    # PyTorch's backward at the head: transformers' fp32 copy's gradient beside log_softmax's and
    # nll's fp32 gradients; Megatron's makes its saved softmax the gradient in place: at least
    # one fp32 buffer a logit fewer at the peak
    assert eager["totals"]["peak_bytes"] - te["totals"]["peak_bytes"] >= 4 * logits
    # what te holds beyond the activations at its peak: the 16-bit gradient and little else
    assert te["memory"]["peak_breakdown"]["temporaries"] <= 4.1 * logits
    assert LOSS_NOTE in te["meta"]["audit"]["plan"] and LOSS_NOTE not in eager["meta"]["audit"].get("plan", [])
    assert F.cross_entropy.__module__ == "torch.nn.functional"          # nothing left installed
