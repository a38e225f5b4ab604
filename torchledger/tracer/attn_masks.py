"""An attention call's explicit mask, and whether a GPU run would have run it causal instead.

Hugging Face builds its 4-D attention mask (``masking_utils.create_causal_mask``) unless it
can see that no token is padded: with an all-ones ``attention_mask`` (or none) on a GPU it
passes no mask and calls SDPA with ``is_causal=True``, so the kernel computes half the pairs.
On fake tensors it cannot read the padding mask (nor the position ids it checks for packed
sequences), so it always builds the mask and calls SDPA with ``attn_mask``: traced as it ran,
that attention is dense, the mask is saved for backward, and the same Llama is slower from
Hugging Face's code than from the reference model.

Fake tensors carry no values, so a mask cannot be recognised from them; :meth:`MaskFacts.state`
recognises it from where it ran instead. An explicit mask is taken for the causal one when

* it has no values to read (a fake or meta tensor: a real one was read by transformers, so a
  mask it still passes has padding in it, and the GPU run would pass it too);
* it is boolean (transformers' SDPA masks are; an additive float mask carries a bias, ALiBi or
  T5's relative positions, which no causal kernel computes) and square over the last two dims
  (queries = keys > 1: the only case transformers' ``_ignore_causal_mask_sdpa`` skips);
* the module that ran it is not marked ``is_causal = False`` (Hugging Face's attention modules
  say whether they are decoder attention) and has no sliding window narrower than the keys
  (Mistral's, Gemma's local layers: their mask is built on a GPU too), and the model's config
  does not say ``is_causal: false`` (transformers then builds a bidirectional mask);
* and the model is a decoder-only causal LM (:func:`causal_lm`: the class or
  ``config.architectures`` ends in ``ForCausalLM`` / ``LMHeadModel``, or ``config.is_decoder``
  without ``is_encoder_decoder``; torchledger's own decoder) or the module says
  ``is_causal = True`` (an encoder-decoder's decoder self-attention).

The state is ``(basis, mask bytes)``: ``basis`` names the evidence (None: an explicit mask not
taken for the causal one), the bytes are the storage of the mask the kernel got (for the CPU
flash kernel SDPA's float copy of the boolean mask: one per call, kept for backward). Known limitations: a
causal LM traced on fake tensors with real padding (a batch of uneven sequences) is priced
as if unpadded; a prefix-LM or image-token mask (Gemma 3's bidirectional image blocks) in a
model whose attention says ``is_causal`` is taken for causal.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MaskFacts", "causal_lm", "explicit_mask"]

#: SDPA-family argument names that carry a mask or an additive bias.
_MASK_ARGS = ("attn_mask", "attn_bias", "bias")
_WHERE: dict = {}    # id(op) -> (index, keyword only) of its mask argument, or None


def _mask_arg(func):
    where = _WHERE.get(id(func), False)
    if where is False:
        where = None
        schema = getattr(func, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.name in _MASK_ARGS:
                where = (i, a.name, a.kwarg_only)
                break
        _WHERE[id(func)] = where
    return where


def explicit_mask(func, args, kwargs):
    """The mask (or bias) tensor an SDPA-family op was called with, else None."""
    where = _mask_arg(func)
    if where is None:
        return None
    i, name, kw_only = where
    m = kwargs.get(name) if kw_only or len(args) <= i else args[i]
    return m if isinstance(m, torch.Tensor) else None


def causal_lm(model) -> Optional[str]:
    """Why ``model`` is a decoder-only causal LM (a few words), or None when it is not one."""
    if model is None:
        return None
    if getattr(model, "config", None) is None and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module                      # DistributedDataParallel
    try:
        from ..models.transformer import Transformer
    except ImportError:                           # pragma: no cover
        Transformer = ()
    if isinstance(model, Transformer):
        return "torchledger's decoder"
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_causal", True) is False or getattr(cfg, "is_encoder_decoder", False):
        return None
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return f"{name}, a causal LM"
    arch = next((a for a in getattr(cfg, "architectures", None) or () if str(a).endswith("ForCausalLM")), None)
    if arch is not None:
        return f"{name} of a {arch} config, a causal LM"
    if getattr(cfg, "is_decoder", False) is True:
        return f"{name} with config.is_decoder, a causal LM"
    return None


def _has_values(t) -> bool:
    local = getattr(t, "_local_tensor", None)     # a DTensor: its local shard
    t = local if isinstance(local, torch.Tensor) else t
    return type(t) is torch.Tensor and t.device.type != "meta"


def _nbytes(t) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:                             # no single storage
        return int(t.numel() * t.element_size())


def _causal_basis(mask, boolean: bool, module, model_reason: Optional[str]) -> Optional[str]:
    if _has_values(mask) or not boolean or mask.dim() < 2:
        return None
    sq, sk = mask.shape[-2], mask.shape[-1]
    if sq != sk or sk < 2:
        return None
    marked = getattr(module, "is_causal", None)
    window = getattr(module, "sliding_window", None)
    if marked is False or (isinstance(window, int) and not isinstance(window, bool) and 0 < window < sk):
        return None
    if model_reason:
        return model_reason
    if marked is True:
        return f"{type(module).__name__}.is_causal"
    return None


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:                             # no single storage
        return None


class MaskFacts:
    """What one traced step knows about its attention masks, for :meth:`state`.

    SDPA hands its CPU flash kernel a boolean mask converted to an additive float one, so the
    op never sees the dtype the model passed: ``bool_call`` is set by the tracer's
    ``F.scaled_dot_product_attention`` wrapper while a call with a boolean ``attn_mask`` runs,
    and the storage of the mask its kernel got is remembered, for the backward kernel that
    gets the same tensor."""

    __slots__ = ("bool_call", "bool_storages", "_reason")

    def __init__(self):
        self.bool_call = False
        self.bool_storages: set = set()
        self._reason = False

    def causal_basis(self, mask, module, model) -> Optional[str]:
        """The evidence that ``mask``, a boolean mask handed to SDPA by ``module`` of
        ``model``, is the causal one a GPU run would not build (see the module doc), or None."""
        try:
            return self._basis(mask, mask.dtype == torch.bool, module, model)
        except Exception:       # a model whose attributes raise: not taken for the causal one
            return None

    def _basis(self, mask, boolean: bool, module, model) -> Optional[str]:
        if self._reason is False:
            self._reason = causal_lm(model)
        return _causal_basis(mask, boolean, module, self._reason)

    def state(self, func, args, kwargs, module, model):
        """``(basis, mask bytes)`` of a fused attention op called with an explicit mask, None
        without one. ``module`` is the module that ran it, ``model`` the traced model; basis
        is None when the mask is not taken for the causal one (see the module doc)."""
        mask = explicit_mask(func, args, kwargs)
        if mask is None:
            return None
        try:
            key = _storage_key(mask)
            boolean = mask.dtype == torch.bool or self.bool_call or (key is not None and key in self.bool_storages)
            if self.bool_call and key is not None:
                self.bool_storages.add(key)
            return self._basis(mask, boolean, module, model), _nbytes(mask)
        except Exception:       # a model whose attributes raise: an explicit mask, nothing more
            return None, 0
