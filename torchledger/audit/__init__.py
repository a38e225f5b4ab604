"""The audit room: what ``torchledger audit`` runs. ``spec`` (the ``AuditSpec`` a model file
returns), ``engine`` (load the file, build the model in the device context, trace the
steps), ``world`` (the simulated world on PyTorch's fake process group), ``pipeline`` (the
pipeline stage runner: one traced process per stage, composed by the schedule) and
``supervise`` (the child process the model file runs in, its timeout and clean-up).

It composes the rooms below it (tracer, record, parallel, steptime, analyzers, render) and
is composed only by the commands (``cli``) and the integrations. ``import torchledger.audit``
loads no torch: the engine imports it when a step runs."""
__all__ = ["AuditRun", "load_entry", "run_audit", "DEVICES", "stdout_to_stderr"]


def __getattr__(name):
    """``torchledger.audit.run_audit`` and the engine's other public names, as before the room
    (the engine loads on first use: the command line forks before torch is imported)."""
    if name in __all__:
        from . import engine          # lazy: the engine imports torch
        return getattr(engine, name)
    raise AttributeError(f"module 'torchledger.audit' has no attribute {name!r}")
