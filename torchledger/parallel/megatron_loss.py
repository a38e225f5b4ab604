"""Megatron-Core's cross-entropy, for steps that describe a Megatron / NeMo run (``--kernels te``).

PyTorch's ``F.cross_entropy`` on 16-bit logits (what transformers' causal-LM loss and
torchtitan run: ``logits.float()`` then ``log_softmax`` and ``nll_loss``) keeps an fp32
log-softmax for backward, and its backward makes an fp32 gradient of the log-softmax, another
of the fp32 logits and a 16-bit copy: up to 4 + 4 + 4 + 2 bytes a logit at the head's backward,
on top of the 16-bit logits. Megatron's ``_VocabParallelCrossEntropy``
(``megatron/core/tensor_parallel/cross_entropy.py``) makes one fp32 copy of the logits and
turns it into the softmax in place (max subtracted, exponentiated, divided by the sum), saves
that, and in backward turns the saved softmax into the gradient in place (the target's column
less one, times the incoming gradient): 4 bytes a logit held, plus the 16-bit gradient the cast
back to the logits' dtype makes (Megatron's ``.float()``'s backward). :func:`megatron_cross_entropy`
swaps ``F.cross_entropy`` for that while a ``--kernels te`` step runs, where it applies (class
targets, no weights or label smoothing, a mean or sum); anything else keeps PyTorch's.

Known limitations: the logits are whole on every tensor-parallel rank (the standard plan's head
gathers them; Megatron's stay split by vocabulary and its loss all-reduces three scalars a
token); an fp32 input is copied (Megatron overwrites it in place; here the caller may still
read it, as transformers returns the logits).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["MegatronCrossEntropy", "megatron_cross_entropy", "LOSS_NOTE"]

LOSS_NOTE = ("loss: Megatron's cross-entropy (--kernels te): one fp32 copy of the logits made the softmax in "
             "place and kept, made the gradient in place in backward (4 B a logit, where PyTorch's log_softmax "
             "and its backward keep up to 14)")


class MegatronCrossEntropy(torch.autograd.Function):
    """Mean (or sum) cross-entropy of ``logits`` (N, V) against class indices ``target`` (N),
    rows whose target is ``ignore_index`` left out, with Megatron's memory: the softmax kept in
    one fp32 buffer that backward turns into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction):
        x = logits.float() if logits.dtype != torch.float32 else logits.clone()
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(-1)
        x.sub_(x.amax(dim=-1, keepdim=True))
        picked = x.gather(-1, safe).squeeze(-1)
        x.exp_()
        total = x.sum(dim=-1, keepdim=True)
        x.div_(total)                                       # the softmax, in the copy
        per_row = (total.squeeze(-1).log() - picked) * valid
        count = valid.sum()
        loss = per_row.sum() / count if reduction == "mean" else per_row.sum()
        ctx.save_for_backward(x, safe, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        return loss                                         # fp32, as Megatron's

    @staticmethod
    def backward(ctx, grad):
        x, safe, valid, count = ctx.saved_tensors
        x.scatter_add_(-1, safe, -valid.unsqueeze(-1).to(x.dtype))     # softmax - one-hot, in place
        scale = grad.float() / count if ctx.reduction == "mean" else grad.float()
        x.mul_((valid.to(x.dtype) * scale).unsqueeze(-1))
        return x.to(ctx.dtype) if ctx.dtype != torch.float32 else x, None, None, None


def _applies(input, target, weight, label_smoothing, reduction) -> bool:
    from torch.distributed.tensor import DTensor
    return (weight is None and not label_smoothing and reduction in ("mean", "sum")
            and isinstance(input, torch.Tensor) and not isinstance(input, DTensor)
            and input.dim() == 2 and input.is_floating_point()
            and isinstance(target, torch.Tensor) and target.dim() == 1
            and not target.is_floating_point() and target.shape[0] == input.shape[0])


def _causal_lm_loss(applied):
    """transformers' ``ForCausalLM`` loss (labels shifted left, -100 ignored, a sum over
    ``num_items_in_batch`` when given) without its ``logits.float()``: Megatron's loss makes
    the one fp32 copy itself."""
    import torch.nn.functional as F

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        logits = logits.reshape(-1, vocab_size)
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        if applied is not None:
            applied["cross_entropy"] = applied.get("cross_entropy", 0) + 1
        if num_items_in_batch is None:
            return MegatronCrossEntropy.apply(logits, shift_labels, ignore_index, "mean")
        total = MegatronCrossEntropy.apply(logits, shift_labels, ignore_index, "sum")
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return loss


@contextlib.contextmanager
def megatron_cross_entropy(applied: dict | None = None):
    """``torch.nn.functional.cross_entropy`` as Megatron's where it applies, and transformers'
    causal-LM loss (``LOSS_MAPPING["ForCausalLM"]``, when transformers is loaded) on it, while
    the block runs (restored after, raised or not); ``applied["cross_entropy"]`` counts the
    calls taken."""
    import sys
    import torch.nn.functional as F
    original = F.cross_entropy
    hf = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(hf, "LOSS_MAPPING", None) if hf is not None else None
    hf_original = mapping.get("ForCausalLM") if isinstance(mapping, dict) else None

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
        if size_average is None and reduce is None and _applies(input, target, weight, label_smoothing, reduction):
            if applied is not None:
                applied["cross_entropy"] = applied.get("cross_entropy", 0) + 1
            return MegatronCrossEntropy.apply(input, target, ignore_index, reduction)
        return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)

    cross_entropy.__wrapped__, cross_entropy.__doc__ = original, original.__doc__
    F.cross_entropy = cross_entropy
    if hf_original is not None:
        mapping["ForCausalLM"] = _causal_lm_loss(applied)
    try:
        yield applied
    finally:
        F.cross_entropy = original
        if hf_original is not None:
            mapping["ForCausalLM"] = hf_original
