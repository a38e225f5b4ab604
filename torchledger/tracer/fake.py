"""Fake tensors that survive ``copy.deepcopy``.

A ``FakeTensor`` keeps its ``FakeTensorMode`` in its ``__dict__``, and ``Tensor.__deepcopy__``
deep-copies that dict: every deep-copied fake tensor (``nn.TransformerEncoder`` and
``nn.TransformerDecoder`` deep-copy their layer, and so does every ``clones()`` helper) gets a
copy of the whole mode. The mode the step runs under then sees a tensor of a foreign mode and
converts it at every op, so the matmul no longer reads the parameter's storage: those weights
vanish from N (three deep-copied ``Linear(64, 64)`` and a head read N = 128 instead of 12,416)
and their activations are counted once per conversion.

``fake_mode()`` is the mode ``torchledger audit --device fake`` builds and steps in: one whose
deep copy is itself (a mode is the context tensors live in, not data to duplicate), so a
deep-copied layer's parameters live in the same mode as the rest of the model.
``foreign_fake_params(params)`` counts the parameters that live in another mode than most of
them (a model built under a plain ``FakeTensorMode`` the user made), for a warning.
"""
from __future__ import annotations

import contextlib
import warnings

__all__ = ["fake_mode", "foreign_fake_params"]


def _same_mode(mode):
    """``copy.deepcopy(mode)``: the mode itself (``copy`` looks ``__deepcopy__`` up on the
    instance, so no class is patched and other modes keep torch's behaviour)."""
    def deepcopy(memo):
        return mode
    return deepcopy


@contextlib.contextmanager
def fake_mode(**kwargs):
    """A ``FakeTensorMode(**kwargs)``, entered, whose deep copy is itself. Meanwhile torch's
    "Accessing the data pointer of FakeTensor is deprecated" warning, which every deep copy
    of a fake tensor raises from torch's own ``Tensor.__deepcopy__`` ("almost definitely a
    bug in your code": it is not the user's), is not shown."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(**kwargs)
    mode.__deepcopy__ = _same_mode(mode)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor is deprecated")
        with mode:
            yield mode


def foreign_fake_params(params) -> int:
    """How many of ``params`` are fake tensors of another ``FakeTensorMode`` than the one most
    of them share (0 for real tensors, or when every fake parameter shares one mode)."""
    counts: dict = {}
    for p in params:
        m = getattr(p, "fake_mode", None)
        if m is not None:
            counts[id(m)] = counts.get(id(m), 0) + 1
    return sum(counts.values()) - max(counts.values()) if len(counts) > 1 else 0
