"""TL-MEM-001: a training forward returned a key/value cache that the step keeps alive.

Hugging Face causal LMs default to ``use_cache=True`` and return every layer's keys and
values even when training. Backward needs them anyway (attention saves them), so the cost
starts when backward is done: the cache keeps them alive through the optimizer step, for as
long as the output object lives. The tracer records the cache's bytes and how many of them
were live at the step's peak and when the optimizer step began (``memory["output_cache"]``).

* warning: the cache is live at the step's peak, the peak is in the optimizer step (so the
  cache raised the peak itself) and it is at least ``cache_share`` of the peak (default 1%);
* info: otherwise, when the cache outlived backward or was returned at all.
"""
from __future__ import annotations

from ..record import Finding
from ..units import fmt_bytes

__all__ = ["check_output_cache"]


def check_output_cache(records, options=None) -> list:
    if not records:
        return []
    rec = records[-1]
    cache = rec.memory.get("output_cache")
    if not cache or not cache.get("bytes"):
        return []
    model = rec.meta.get("model") or "the model"
    at_peak, at_opt = cache.get("bytes_at_peak") or 0, cache.get("bytes_at_optimizer")
    peak, phase = rec.totals.get("peak_bytes") or 0, rec.totals.get("peak_phase")

    def size(n) -> str:
        return fmt_bytes(n, binary=True)

    what = (f"{model} returned a key/value cache ({cache.get('cache_type')}, output field "
            f"`{cache.get('field')}`) from a training forward: {size(cache['bytes'])} of keys "
            f"and values in {cache.get('tensors')} tensors, which a training step never reads")
    share = float((options or {}).get("cache_share", 0.01))
    if at_peak and phase == "optimizer" and peak and at_peak >= share * peak:
        severity = "warning"
        cost = (f"; it stays alive through the optimizer step, where the peak is: "
                f"{size(at_peak)} of the {size(peak)} peak ({at_peak / peak:.1%})")
    elif at_opt:
        severity = "info"
        cost = f"; {size(at_opt)} of it is still alive when the optimizer step begins"
    else:
        severity = "info"
        cost = ""
    return [Finding("TL-MEM-001", severity, what + cost, module="",
                    measured=at_peak if severity == "warning" else (at_opt or cache["bytes"]),
                    expected=0,
                    hint="when training, pass use_cache=False (or set model.config.use_cache = False), "
                         "or drop the output before optimizer.step()")]
