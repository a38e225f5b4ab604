"""``AuditSpec``: what a model file hands to ``torchledger audit``, and what its empty fields
become (the loss picked from the output, the tokens read off the inputs).

A model file defines a function (default ``audit_spec``) that takes no arguments and
returns an ``AuditSpec`` (or a plain dict with the same keys). The function is called
inside the device context the audit runs on (a FakeTensorMode, the meta device, CPU or
CUDA), so the model and inputs it builds land there::

    def audit_spec():
        model = build_model("gpt2")
        idx = torch.randint(0, 50257, (8, 1024))
        return torchledger.AuditSpec(model, {"idx": idx, "targets": idx})
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple, Optional

from .record import SAMPLES_NOT_TOKENS

__all__ = ["AuditSpec", "AuditError", "as_spec", "pick_loss", "default_loss", "infer_tokens", "default_tokens",
           "TokenCount", "tokens_warning"]


class AuditError(Exception):
    """Bad input for an audit: the message is one line for the user."""


@dataclass
class AuditSpec:
    """One training step, described."""

    model: Any
    """The ``nn.Module`` (built inside the call, so fake/meta modes apply)."""
    inputs: Any
    """A tensor, tuple or dict passed to ``model(...)`` (dict: keyword arguments)."""
    loss_fn: Optional[Callable] = None
    """``(model_output, inputs) -> scalar``; default (:func:`pick_loss`): the output if
    scalar, else ``output.loss`` / ``output["loss"]``, else the first scalar tensor of a tuple
    or list (``output[1]`` of nanoGPT's ``(logits, loss)``), else the mean of the logits
    (``output.logits`` / ``output[0]``: no real loss). Reports say which (``loss: output[1]``,
    from ``meta.audit.loss``)."""
    optimizer: Optional[Callable] = None
    """``(params) -> Optimizer``; default ``torch.optim.AdamW``."""
    step: Optional[Callable] = None
    """``(model, inputs, optimizer) -> None``: the user's own step, replacing the default."""
    tokens: Optional[int] = None
    """Tokens per step (D of 6ND); default read off ``inputs`` (:func:`infer_tokens`): the
    numel of 2-D integer token ids ``[B, T]``, else the count of a list of ``[C, H, W]``
    images (detection), else the rows of a 2-3 dim float ``[B, (T,) d]``, else the batch of
    an image-like tensor (float 4+ dims, integer 3+; with a list of images, D counts samples,
    not tokens), else the numel of a 1-D tensor (labels); among tensors of one kind a key
    with ``ids`` in it (``input_ids``) first, one with ``mask`` (``attention_mask``) last.
    Reports say which (``totals.tokens_source``)."""
    seq_len: Optional[int] = None
    """Sequence length, for the attention term; default: the last dim of the token ids."""
    parallelize: Optional[Callable] = None
    """``(model, mesh) -> model``: shard the model for a simulated world
    (``audit --world-size N [--mesh 8x8]``, :mod:`torchledger.world`): apply FSDP2
    (``torch.distributed.fsdp.fully_shard``) and/or tensor parallelism
    (``torch.distributed.tensor.parallel.parallelize_module``) over the ``DeviceMesh`` and
    return the model. ``inputs`` are then one rank's batch. Not called in a plain
    (single-process) audit; needed at a world size above 1."""

    def __post_init__(self):
        import torch
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"AuditSpec.model must be an nn.Module, got {type(self.model).__name__}")
        for name in ("loss_fn", "optimizer", "step", "parallelize"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"AuditSpec.{name} must be callable or None, got {type(value).__name__}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens <= 0):
            raise TypeError(f"AuditSpec.tokens must be a positive int, got {self.tokens!r}")


_KEYS = {f.name for f in fields(AuditSpec)}


def as_spec(obj) -> AuditSpec:
    """An ``AuditSpec`` from an ``AuditSpec`` or a dict with its keys; TypeError otherwise."""
    if isinstance(obj, AuditSpec):
        return obj
    if isinstance(obj, dict):
        unknown = set(obj) - _KEYS
        if unknown:
            raise TypeError(f"unknown AuditSpec key(s) {', '.join(sorted(map(str, unknown)))}; "
                            f"expected {', '.join(sorted(_KEYS))}")
        if "model" not in obj or "inputs" not in obj:
            raise TypeError("an AuditSpec dict needs at least 'model' and 'inputs'")
        return AuditSpec(**obj)
    raise TypeError(f"expected an AuditSpec or a dict with 'model' and 'inputs', "
                    f"got {type(obj).__name__}")


# -- the defaults of a spec's empty fields ---------------------------------------------------------
def default_loss(output, inputs=None):
    """The loss :func:`pick_loss` picks from the model's output (without where it came from)."""
    return pick_loss(output)[0]


def pick_loss(output):
    """``(loss, source)``: the scalar a default audit step backpropagates, and where it came
    from (``meta.audit.loss``, printed as ``loss: output[1]`` in every report).

    In order: the output itself if it is a scalar tensor (``output``); ``output.loss`` (a
    Hugging Face ModelOutput) or ``output["loss"]`` (a dict); the first 0-dim floating tensor
    of a tuple or list (``output[1]`` of nanoGPT's ``(logits, loss)``, ``output[0]`` of
    Hugging Face's ``return_dict=False``); else the mean of the logits
    (``output.logits``, ``output["logits"]``, ``output[0]``, or the output tensor itself), which
    runs the model's FLOPs but is no real loss, and the source says so.
    """
    import torch
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output, "output"
        return output.float().mean(), "output.float().mean() (no loss in the output)"
    for source, get in (("output.loss", lambda o: getattr(o, "loss", None)),
                        ('output["loss"]', lambda o: o.get("loss") if isinstance(o, dict) else None)):
        loss = get(output)
        if isinstance(loss, torch.Tensor):
            return loss, source
    if isinstance(output, (tuple, list)):
        for i, v in enumerate(output):
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
                return v, f"output[{i}]"
    for source, get in (("output.logits", lambda o: getattr(o, "logits", None)),
                        ('output["logits"]', lambda o: o.get("logits") if isinstance(o, dict) else None),
                        ("output[0]", lambda o: o[0] if isinstance(o, (tuple, list)) and o else None)):
        logits = get(output)
        if isinstance(logits, torch.Tensor):
            return logits.float().mean(), f"{source}.float().mean() (no loss in the output)"
    raise AuditError(f"cannot make a loss from the model's output ({type(output).__name__}); "
                     f"give AuditSpec(loss_fn=...)")


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


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
