"""torchledger: resource accounting for PyTorch training steps.

    import torchledger
    with torchledger.trace(model, optimizer=opt, tokens=B * T) as t:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    print(t.report())

Heavy parts (torch, pandas) load on first use, so ``torchledger estimate`` stays fast.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "trace": ("torchledger.ledger", "trace"),
    "Ledger": ("torchledger.ledger", "Ledger"),
    "StepTracer": ("torchledger.tracer", "StepTracer"),
    "StepRecord": ("torchledger.record", "StepRecord"),
    "Finding": ("torchledger.record", "Finding"),
    "AuditSpec": ("torchledger.audit.spec", "AuditSpec"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchledger' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
