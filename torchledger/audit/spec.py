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
from typing import Any, Callable, Optional

from ..record.tokens import TokenCount, default_tokens, infer_tokens, tokens_warning

__all__ = ["AuditSpec", "AuditError", "as_spec", "pick_loss", "default_loss", "infer_tokens", "default_tokens",
           "TokenCount", "tokens_warning", "call_model"]


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
    (``audit --world-size N [--mesh 8x8]``, :mod:`torchledger.audit.world`): apply FSDP2
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


def call_model(model, inputs):
    """``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``, by the inputs' type."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
