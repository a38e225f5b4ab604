"""``AuditSpec``: what a model file hands to ``torchledger audit``.

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

__all__ = ["AuditSpec", "as_spec"]


@dataclass
class AuditSpec:
    """One training step, described."""

    model: Any
    """The ``nn.Module`` (built inside the call, so fake/meta modes apply)."""
    inputs: Any
    """A tensor, tuple or dict passed to ``model(...)`` (dict: keyword arguments)."""
    loss_fn: Optional[Callable] = None
    """``(model_output, inputs) -> scalar``; default (``audit.pick_loss``): the output if
    scalar, else ``output.loss`` / ``output["loss"]``, else the first scalar tensor of a tuple
    or list (``output[1]`` of nanoGPT's ``(logits, loss)``), else the mean of the logits
    (``output.logits`` / ``output[0]``: no real loss). Reports say which (``loss: output[1]``,
    from ``meta.audit.loss``)."""
    optimizer: Optional[Callable] = None
    """``(params) -> Optimizer``; default ``torch.optim.AdamW``."""
    step: Optional[Callable] = None
    """``(model, inputs, optimizer) -> None``: the user's own step, replacing the default."""
    tokens: Optional[int] = None
    """Tokens per step (D of 6ND); default read off ``inputs`` (``audit.infer_tokens``): the
    numel of 2-D integer token ids ``[B, T]``, else the rows of a 2-3 dim float ``[B, (T,) d]``,
    else the batch of an image-like tensor (float 4+ dims, integer 3+: D then counts samples,
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
