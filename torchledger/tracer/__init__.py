"""The tracer: hooks that observe one real training step and hand back a plain ``StepRecord``.

``StepTracer`` installs a TorchDispatchMode (FLOPs and bytes per op, module and phase),
saved-tensor hooks (activations), module hooks and an optimizer-state walk, and on CUDA the
allocator's history; on exit it removes all of them and builds the record. It records and
judges nothing: predictions, comparisons and findings are the analyzers' (composed by
:mod:`torchledger.ledger`, whose ``trace()`` and ``Ledger`` are the public API).

* :mod:`.step` - ``StepTracer``: install, observe, remove, build.
* :mod:`.dispatch` - the dispatch mode: per-op FLOPs, bytes, copies, phases.
* :mod:`.flops`, :mod:`.flops_attention` - FLOP formulas per op (attention kernels apart).
* :mod:`.memory`, :mod:`.retention` - live memory by category; what outlives the step.
* :mod:`.modules`, :mod:`.shape`, :mod:`.outputs` - module scopes, architecture, returned caches.
* :mod:`.build` - the record from what was observed.
* :mod:`.lifecycle`, :mod:`.compiled` - safe install/remove (Ctrl-C, threads), torch.compile.
* :mod:`.cuda_history`, :mod:`.peak` - the CUDA allocator's history, a measured matmul peak.

Works on CPU, CUDA, meta and fake tensors. One tracer may be active at a time.
"""
from __future__ import annotations

from .step import StepTracer, active_tracer, check_optimizer

__all__ = ["StepTracer", "active_tracer", "check_optimizer"]
