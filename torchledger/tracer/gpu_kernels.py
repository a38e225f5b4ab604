"""On fake tensors, the kernels a GPU runs where CPU's keep other tensors for backward.

A fake step takes CPU's dispatch (fake tensors are CPU tensors without data), yet it describes
a GPU run (``audit --gpu``). Where PyTorch takes another path on CUDA than on CPU, and that
path keeps other tensors for backward, the step runs the CUDA path on fake tensors while it is
traced, as the latent-attention plan runs the memory-efficient kernel (``parallel.hf_mla``).
From ``tools/autograd/derivatives.yaml`` and the kernels (PyTorch 2.13):

- ``F.rms_norm`` (``nn.RMSNorm``): on CUDA ``rms_norm`` calls ``_fused_rms_norm`` (weight
  absent or of the input's dtype, not channels-last, not complex), whose autograd keeps the
  input and rstd (fp32, one a row): 2 B an element in bf16. CPU has no such kernel: the
  composite upcasts to fp32 and keeps the upcast input and the normalised product, 8 B an
  element, 4x. Here: ``_fused_rms_norm`` below autograd (one op, as on the GPU) and
  ``_fused_rms_norm_backward`` in backward.
- ``F.dropout`` in training, 0 < p < 1, not in place: on CUDA ``native_dropout``, which keeps a
  bool mask (1 B an element); on CPU the input times a noise tensor of the input's dtype, kept
  (4 B an element in fp32, 2 in bf16). Here: ``native_dropout``. In place, both devices
  multiply by the noise: unchanged.
- ``F.scaled_dot_product_attention`` given a boolean mask by a causal LM (Hugging Face's
  ``create_causal_mask``, which cannot read a fake padding mask and so always builds one): on a
  GPU with no padded token transformers passes no mask and ``is_causal=True``; on CPU SDPA
  converts the mask to an fp32 copy (T x T a call, 4 B an element) that its kernel keeps for
  backward. Here, where :meth:`.attn_masks.MaskFacts.causal_basis` takes the mask for the causal
  one (as the time model prices it): no mask and ``is_causal=True``, queries as many as keys.

- ``torch.optim``'s default implementation (``foreach=None``): on CUDA the foreach path for
  plain tensors and DTensors (``_default_to_fused_or_foreach``), whose intermediates are a
  list over every parameter of the group at once (AdamW's ``_foreach_sqrt`` of the second
  moments: 4 B a fp32 parameter beside the weights, gradients and moments, "O(n) more memory"
  as PyTorch's own Adafactor foreach PR puts it); on CPU the for-loop, one parameter's at a
  time. Here: the GPU's choice (a mix of DTensors and plain tensors, which the foreach ops
  refuse on a GPU, keeps the for-loop). Llama-2-7B in fp32 on one GPU: 101.4 -> 125.5 GiB at
  the optimizer step.

The same on both (checked, not changed): ``gelu`` and ``silu`` keep their input,
``_softmax``/``_log_softmax`` their output, ``native_layer_norm`` input, mean and rstd (CUDA
keeps mean and rstd in fp32 where CPU keeps them in a 16-bit input's dtype when the weights
are 16-bit too: 4 B a row of each norm, left as CPU has it), SDPA (see ``tracer.build``).

Known limitations: only calls through ``torch.nn.functional`` are seen (``torch.rms_norm``
called directly keeps CPU's path); a DTensor input to dropout keeps CPU's path (rms_norm on a
DTensor of fake shards, sequence parallelism's norms, takes the fused kernel: DTensor has its
sharding strategy on CUDA).
"""
from __future__ import annotations

import torch

__all__ = ["gpu_kernel_hook", "KERNEL_NOTES"]

#: What each substitution means, for the record's notes (``meta["gpu_kernels"]``).
KERNEL_NOTES = {
    "rms_norm": "rms_norm as CUDA's fused kernel (_fused_rms_norm: keeps the input and an fp32 rstd a row, "
                "where CPU's composite keeps fp32 copies)",
    "dropout": "dropout as CUDA's native_dropout (keeps a 1-byte mask, where CPU keeps a noise tensor of "
               "the input's dtype)",
    "optimizer_foreach": "the optimizer's implementation chosen as on a GPU: PyTorch's foreach path for plain "
                         "tensors and DTensors (its intermediates, e.g. AdamW's sqrt of the second moments, one "
                         "list over every parameter at once), where CPU takes the for-loop, one parameter at "
                         "a time",
    "optimizer_mixed": "the optimizer's parameters mix DTensors and plain tensors (tensor parallelism without "
                       "FSDP over the rest): on a GPU torch.optim's default foreach path raises on the mix "
                       "(\"got mixed torch.Tensor and DTensor\"); the step ran the for-loop, as foreach=False "
                       "would: pass foreach=False to the optimizer, or shard every parameter",
    "causal_mask": "a causal LM's boolean attention mask passed to SDPA as is_causal=True and no mask, as "
                   "transformers calls it on a GPU when no token is padded (fake tensors hold no values to "
                   "check; where CPU's kernel keeps an fp32 copy of the mask, T x T a call)",
}


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` with its CUDA autograd (derivatives.yaml): keeps input, rstd, weight."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        with torch._C._AutoDispatchBelowAutograd():     # else CPU's composite decomposes it
            out, rstd = torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)
        ctx.shape = list(shape)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight, mask)
        return gx, None, gw if mask[1] else None, None


def _fake_kind(t, fake):
    """"plain" for a fake tensor (or a parameter of one), "dtensor" for a DTensor whose local
    shard is fake (tensor or sequence parallelism on fake tensors), else None."""
    if type(t) is fake or (type(t) is torch.nn.Parameter and isinstance(t, fake)):
        return "plain"
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        with torch.no_grad():
            return "dtensor" if type(t.to_local()) is fake else None
    return None


def _fused_rms_norm_applies(x, weight, fake) -> bool:
    """``rms_norm_symint``'s conditions for the fused kernel, on a fake tensor or a DTensor of
    fake shards (on CUDA a DTensor takes the same path: ``rms_norm`` decomposes above the
    DTensor and ``_fused_rms_norm`` and its backward have DTensor sharding strategies,
    ``torch/distributed/tensor/_ops/_math_ops.py``)."""
    kind = _fake_kind(x, fake)
    return (kind is not None and (weight is None or (_fake_kind(weight, fake) == kind
                                                     and weight.dtype == x.dtype))
            and not x.is_complex() and x.dim() > 0
            and (x.dim() not in (4, 5) or x.is_contiguous()))     # channels-last: the composite


def _causal_call(args, kwargs, fake, where, masks):
    """(args, kwargs) of an SDPA call whose explicit boolean mask is the causal one a GPU run
    would not build (``masks.causal_basis``), with no mask and ``is_causal=True``; else None.
    Queries as many as keys (``is_causal`` aligns top-left: the causal mask only then), fake
    operands, no scale or GQA argument moved."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    got = dict(zip(names, args))
    if len(args) > len(names) or any(k in got for k in kwargs):
        return None
    got.update(kwargs)
    mask, q, k = got.get("attn_mask"), got.get("query"), got.get("key")
    if (mask is None or got.get("is_causal") or getattr(mask, "dtype", None) is not torch.bool
            or q is None or k is None or q.dim() < 2 or q.shape[-2] != k.shape[-2]
            or _fake_kind(q, fake) != "plain" or _fake_kind(mask, fake) != "plain"):
        return None
    module, model = where()
    if not masks.causal_basis(mask, module, model):
        return None
    got.update(attn_mask=None, is_causal=True)
    return (), got


def _gpu_optimizer_default(life, ours, applied: dict, fake) -> None:
    """torch.optim's default implementation (``foreach=None``) as a GPU picks it: the foreach
    path when every parameter is a Tensor, Parameter or DTensor on a device with foreach
    kernels (CUDA), the for-loop on CPU. A fake step's CPU tensors stand for CUDA ones and a
    fake parameter's type (FakeTensor) for a Parameter. Parameters that mix DTensors and plain
    tensors (tensor parallelism without FSDP over the rest) keep the for-loop: on a GPU the
    foreach ops raise on the mix ("got mixed torch.Tensor and DTensor"). Other threads'
    optimizers decide as torch does."""
    import sys
    import torch.optim.optimizer as optimizer_module
    from torch.distributed.tensor import DTensor
    decide = optimizer_module._default_to_fused_or_foreach
    devices = optimizer_module._get_foreach_kernels_supported_devices
    types = [*optimizer_module._foreach_supported_types, fake]

    def gpu_default(params, differentiable, use_fused=False):
        fused, foreach = decide(params, differentiable, use_fused)
        if fused or foreach or differentiable or not ours():
            return fused, foreach
        kinds = {isinstance(p, DTensor) for p in params if p is not None}
        if len(kinds) > 1:
            applied["optimizer_mixed"] = applied.get("optimizer_mixed", 0) + 1
            return fused, False
        gpu = devices()
        foreach = all(p is None or (type(p) in types and (type(p) is fake or isinstance(p, DTensor)
                                                          or p.device.type in gpu)) for p in params)
        if foreach:
            applied["optimizer_foreach"] = applied.get("optimizer_foreach", 0) + 1
        return fused, foreach

    # each optimizer module imported the function by name (``from .optimizer import ...``)
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("torch.optim")]:
        if getattr(module, "_default_to_fused_or_foreach", None) is decide:
            life.patch(module, "_default_to_fused_or_foreach", gpu_default)


def gpu_kernel_hook(life, ours, applied: dict, where=None, masks=None) -> None:
    """Patch ``F.rms_norm``, ``F.dropout`` and, with ``where`` (-> (module, model) running) and
    ``masks`` (the step's :class:`~.attn_masks.MaskFacts`), ``F.scaled_dot_product_attention``
    (through ``life``, undone with the step) to run the CUDA path on fake tensors of the
    step's thread; ``applied`` counts each substitution."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensor

    rms_norm, dropout, sdpa = F.rms_norm, F.dropout, F.scaled_dot_product_attention

    def gpu_rms_norm(input, normalized_shape, weight=None, eps=None):
        if ours() and _fused_rms_norm_applies(input, weight, FakeTensor):
            applied["rms_norm"] = applied.get("rms_norm", 0) + 1
            shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
            return _FusedRMSNorm.apply(input, shape, weight, eps)
        return rms_norm(input, normalized_shape, weight, eps)

    def gpu_dropout(input, p=0.5, training=True, inplace=False):
        if (training and not inplace and 0 < p < 1 and type(input) is FakeTensor and input.numel() > 0
                and ours()):
            applied["dropout"] = applied.get("dropout", 0) + 1
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def gpu_sdpa(*args, **kwargs):
        if ours() and where is not None:
            try:
                causal = _causal_call(args, kwargs, FakeTensor, where, masks)
            except Exception:  # noqa: BLE001  (the tracer's own check never fails the user's step)
                causal = None
            if causal is not None:
                applied["causal_mask"] = applied.get("causal_mask", 0) + 1
                return sdpa(*causal[0], **causal[1])
        return sdpa(*args, **kwargs)

    _gpu_optimizer_default(life, ours, applied, FakeTensor)
    for name, new, old in (("rms_norm", gpu_rms_norm, rms_norm), ("dropout", gpu_dropout, dropout),
                           ("scaled_dot_product_attention", gpu_sdpa, sdpa)):
        # NB: the original's name too: code that patches F by the function's __name__
        # (context_parallel's _distribute_function) must find the attribute it replaces
        new.__wrapped__, new.__doc__, new.__name__, new.__qualname__ = old, old.__doc__, old.__name__, old.__qualname__
        life.patch(F, name, new)
