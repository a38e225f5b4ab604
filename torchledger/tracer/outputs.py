"""What the model hands back from a training forward that it need not: a key/value cache.

Hugging Face causal LMs default to ``use_cache=True`` and return the keys and values of every
layer (``past_key_values``, ``cache`` in newer releases) even from a training forward. A
training step never reads them, but they stay alive for as long as the output object does:
in the usual loop (``out = model(**batch); out.loss.backward(); opt.step()``) that is through
the optimizer step, where the peak of a large model often is. Here we only find the cache's
tensors in the output; ``build`` measures their bytes against the step's live memory.

Known limitations: only caches reachable from a few well-known names (see ``CACHE_NAMES``) in
a mapping output or an object's attributes are found; a cache kept elsewhere (a module
attribute) is what the module-cache leak check is for.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["output_cache", "CACHE_NAMES"]

#: Where models return a key/value cache (newest Hugging Face name first: reading the older
#: name on a new output logs a deprecation warning to the user).
CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "kv_cache")
_MAX_DEPTH = 4
_MAX_TENSORS = 100_000


def output_cache(output):
    """``(name, cache type name, tensors)`` of the key/value cache in ``output``, else None."""
    if isinstance(output, Mapping):          # HF ModelOutput: only the fields that are set. NB:
        fields = list(output.keys())         # ``name in output`` would log HF's deprecation notice
    else:
        fields = getattr(output, "__dict__", None)
        fields = fields if isinstance(fields, dict) else {}
    for name in CACHE_NAMES:
        if name not in fields:
            continue
        value = output[name] if isinstance(output, Mapping) else fields[name]
        if value is None:
            continue
        tensors = _tensors(value)
        if tensors:
            return name, type(value).__name__, tensors
    return None


def _tensors(obj) -> list:
    """Tensors reachable from ``obj`` through containers and plain attributes (not modules)."""
    out, seen, todo = [], set(), [(obj, 0)]
    while todo and len(out) < _MAX_TENSORS:
        x, depth = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif depth >= _MAX_DEPTH or isinstance(x, (torch.nn.Module, str, bytes, int, float, bool)):
            continue
        elif isinstance(x, Mapping):
            todo.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend((v, depth + 1) for v in x)
        elif isinstance(getattr(x, "__dict__", None), dict):
            todo.extend((v, depth + 1) for v in vars(x).values())
    return out
