"""Tokens per step (D of 6ND) and the sequence length (T) read off a step's inputs: one rule for
the audit, the tracer's ``seq_len`` inference and the Python API (``trace(...)``)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from .core import SAMPLES_NOT_TOKENS

__all__ = ["TokenCount", "infer_tokens", "default_tokens", "tokens_warning"]


class TokenCount(NamedTuple):
    """D for an audit and where it came from (``source`` goes to ``totals.tokens_source``)."""

    tokens: Optional[int]
    seq_len: Optional[int]
    source: str


def infer_tokens(inputs, model=None) -> TokenCount:
    """Tokens per step (D of 6ND) read off the step's ``inputs``, with where it came from.

    The tensors of ``inputs`` (a tensor, a tuple/list, a dict such as Hugging Face's
    ``input_ids``/``attention_mask``/``labels``/``pixel_values``, nested up to 4 levels) are
    ranked; the first tensor of the best rank wins:

    1. an integer tensor of 2 dims, token ids ``[B, T]``: its numel (``seq_len`` = T);
    2. a list of ``[C, H, W]`` float images (C of 1, 3 or 4) inside the inputs (torchvision
       detection's ``(images, targets)``): their count, samples (ahead of the targets' float
       boxes); else a float tensor of 4+ dims or an integer one of 3+ (images, latents, video,
       uint8 pixels, segmentation maps, ``[B, C, H, W, ...]``): its batch B. D then counts
       **samples, not tokens**, and the source says so;
    3. a float tensor of 2-3 dims, ``[B, d]`` or ``[B, T, d]``: its rows (numel / last dim).
       Beside an image it is conditioning (a UNet's ``encoder_hidden_states``), not counted;
    4. a 1-D integer tensor (class labels, or a packed token stream): its numel, used only
       when nothing above exists (a vision batch's ``labels [B]`` never wins over its pixels);
    5. a 1-D float tensor: its numel.

    Among tensors of the same rank, one whose dict key contains ``ids`` (``input_ids``,
    ``decoder_input_ids``) comes first and one whose key contains ``mask``
    (``attention_mask``) last; otherwise the first in order wins. So an integer
    ``attention_mask [4, 7]`` listed before ``input_ids [4, 10]`` does not set D.

    Bool tensors (masks), 0-dim and empty tensors are skipped; with nothing left ``tokens`` is
    None and the source says why. ``AuditSpec(tokens=...)`` overrides all of this.

    With ``model``: a model whose lookups are all ``nn.EmbeddingBag`` (a recommender, DLRM)
    takes integer inputs as bags of ids per sample, not token sequences; they are skipped and a
    float ``[B, d]`` (its dense features) counts B samples. :func:`tokens_warning` says when D
    was guessed from a tensor that is not a token-id sequence.
    """
    best, found = _best(inputs, _bags_only(model))
    if best is None:
        why = ("no countable tensor in inputs (bool, 0-dim and empty tensors are skipped)" if found
               else "no tensor in inputs")
        return TokenCount(None, None, why)
    return TokenCount(*best[1])


def tokens_warning(inputs, model=None):
    """A warning for the record when :func:`infer_tokens` guessed D from a tensor that is not a
    token-id sequence and could have taken another (a recommender's ids, which index
    ``nn.EmbeddingBag`` bags; an image beside float rows such as a UNet's
    ``encoder_hidden_states``), with what to pass; None otherwise."""
    bags = _bags_only(model)
    best, found = _best(inputs, bags)
    return None if best is None else _doubt(best, found, bags)


def _best(inputs, bags: bool):
    """``(best, found)``: the winning ``(order, (tokens, seq_len, source))`` of
    :func:`infer_tokens`'s rule (None when nothing counts) and every ``(path, key, tensor)``."""
    found = list(_tensors(inputs, "inputs"))
    best = None
    for position, (path, key, t) in enumerate(found):
        ranked = _rank(path, t, bags)
        order = None if ranked is None else (ranked[0], _name_order(key), position)
        if isinstance(key, _Image):         # one image of a detection-style list: the list counts,
            if key.index:                   # ahead of its targets' float boxes [n, 4]
                continue
            ranked = (2, key.count, None, f"count of {key.path}, a list of {key.count} images "
                                          f"{list(t.shape)}, ...: {SAMPLES_NOT_TOKENS}")
            order = (2, -1, position)
        if order is not None and (best is None or order < best[0]):
            best = (order, ranked[1:])
    return best, found


_PASS = "pass AuditSpec(tokens=..., seq_len=...) to count the step's tokens otherwise"


def _doubt(best, found, bags):
    """:func:`tokens_warning` for the tensor that won (``best``): None when D is token ids,
    a plain batch of images or the rows of float features."""
    rank, (tokens, _, source) = best[0][0], best[1]
    ids = ", ".join(p for p, _, t in found if not (t.is_floating_point() or t.is_complex()) and t.dim())
    if bags and ids:
        return (f"tokens per step (D) = {tokens:,} samples ({source}): the integer inputs ({ids}) index "
                f"nn.EmbeddingBag tables, bags of ids per sample, not token sequences; {_PASS}")
    if rank == 2:
        rows = [f"{p} {list(t.shape)}" for p, key, t in found if t.is_floating_point() and t.dim() == 3
                and not isinstance(key, _Image)]
        if rows:
            return (f"tokens per step (D) = {tokens:,} samples ({source}); {', '.join(rows)} beside it "
                    f"is not counted (float rows: conditioning such as a UNet's encoder_hidden_states, "
                    f"not token ids); {_PASS}")
    return None


def _bags_only(model) -> bool:
    """``model``'s lookups are ``nn.EmbeddingBag`` tables and none an ``nn.Embedding``."""
    if model is None:
        return False
    import torch.nn as nn
    kinds = {type(m) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    return bool(kinds) and all(issubclass(k, nn.EmbeddingBag) for k in kinds)


def default_tokens(inputs):
    """``(tokens, seq_len)`` of :func:`infer_tokens` (its rule; without the source)."""
    count = infer_tokens(inputs)
    return count.tokens, count.seq_len


def _tensors(x, path: str, depth: int = 0, key=None):
    """``(path, key, tensor)`` for each tensor in ``x``, in order: ``inputs['input_ids']``,
    ``inputs[0]``; ``key`` is the innermost dict key above the tensor (None if there is none)."""
    import collections.abc

    import torch
    if isinstance(x, torch.Tensor):
        yield path, key, x
    elif depth >= 4:
        return
    elif isinstance(x, collections.abc.Mapping):
        for k, v in x.items():
            yield from _tensors(v, f"{path}[{k!r}]", depth + 1, k)
    elif isinstance(x, (tuple, list)):
        images = depth > 0 and isinstance(x, list) and _is_image_list(x)
        for i, v in enumerate(x):
            yield from _tensors(v, f"{path}[{i}]", depth + 1,
                                _Image(path, i, len(x)) if images else key)


class _Image(NamedTuple):
    """The key :func:`_tensors` gives an image of a list of images (``path``: the list's)."""
    path: str
    index: int
    count: int


def _is_image_list(x: list) -> bool:
    """A list of ``[C, H, W]`` float images, C in 1, 3, 4 (grey, RGB, RGBA): what torchvision's
    detection and segmentation models take (``model(images, targets)``), each image its own
    size. Only a list inside the inputs: the inputs' own tuple is the positional arguments."""
    import torch
    return bool(x) and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3
                           and t.shape[0] in (1, 3, 4) and t.numel() for t in x)


def _name_order(key) -> int:
    """Tie-break among tensors of one rank by the innermost dict key above them: 0 for a key
    with ``ids`` in it (``input_ids``), 2 for one with ``mask`` (``attention_mask``), else 1."""
    key = "" if key is None else str(key).lower()
    if "mask" in key:
        return 2
    return 0 if "ids" in key else 1


def _rank(path: str, t, bags: bool = False):
    """``(rank, tokens, seq_len, source)`` of one tensor under :func:`infer_tokens`'s rule, or
    None when it is skipped (``bags``: integer tensors, a recommender's ids)."""
    import torch
    if t.dtype == torch.bool or t.dim() == 0 or t.numel() == 0:
        return None
    shape = list(t.shape)
    where = f"{path} {shape}"
    integer = not (t.is_floating_point() or t.is_complex())
    if integer and bags:
        return None
    if bags and t.dim() == 2:
        return 3, int(shape[0]), None, f"batch of {where}, a recommender's features: {SAMPLES_NOT_TOKENS}"
    if integer and t.dim() == 2:
        return 1, int(t.numel()), int(shape[1]), f"numel of {where}"
    if t.dim() >= (3 if integer else 4):
        return 2, int(shape[0]), None, f"batch of {where}: {SAMPLES_NOT_TOKENS}"
    if not integer and t.dim() in (2, 3):
        return 3, int(t.numel() // shape[-1]), None, f"rows of {where}"
    if integer:
        return 4, int(t.numel()), None, f"numel of {where}: 1-D, no 2-D token ids"
    return 5, int(t.numel()), None, f"numel of {where}: 1-D"
