"""The audit engine behind ``torchledger audit FILE.py``: load the user's model file, build
its spec on the chosen device, run and trace ``steps`` training steps, and hand back the
records. Every failure the user can cause becomes an ``AuditError`` with one line that says
what was expected, what arrived and what to do; the CLI prints it and exits 2.

Devices: ``fake`` (default) runs the step on FakeTensors with CPU kernels, so a 7B model
audits on a laptop with no real memory; ``meta`` runs on the meta device (attention takes
the math path); ``cpu`` and ``cuda`` run the real step.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Optional

from ..analyzers.compare import record_predictions
from ..analyzers.mfu import mfu_totals
from ..ledger import Ledger
from ..parallel.plan import default_optimizer, make_optimizer
from ..record import TOKENS_FROM_SPEC
from ..record.tokens import infer_tokens, tokens_warning
from ..render.sarif import spec_location
from .errors import USER_ERRORS, device_hint, raised, step_error, where
from .layouts import (accumulated, batch_part, cp_part, keep_blocks, parallelize, resolve, resolve_layout,
                      kernel_notes, standard_plan, step_kernels)
from .loading import (DEVICES, AuditRun, device_context, fake_safe_init, load_entry, quiet_torch_logs,  # noqa: F401
                      stdout_to_stderr, to_device)
from .spec import AuditError, as_spec, call_model, pick_loss
from .pipeline import run_pipeline_audit
from .world import WorldError, fake_world

__all__ = ["AuditRun", "load_entry", "run_audit", "DEVICES", "stdout_to_stderr"]


def run_audit(path: str, entry: str = "audit_spec", device: str = "fake", steps: int = 3,
              peak_flops=None, timing_steps: Optional[int] = None, torch_logs: bool = False,
              world_size: Optional[int] = None, mesh=None, plan: Optional[dict] = None, schedules=None):
    """Load, build, run and trace ``steps`` training steps; returns an ``AuditRun``.

    torch's own error logs of a failing fake kernel are silenced meanwhile (the failure comes
    back as one ``AuditError``) unless ``torch_logs`` is true.

    On ``cpu``/``cuda`` the MFU's step time comes from untraced steps after the traced ones
    (:func:`time_untraced`): ``timing_steps`` of them, or by default as many as make a steady
    median (3 to 20); 0 times none (MFU then from the traced steps, tracer overhead included).

    ``world_size`` and/or ``mesh`` (``"8x8"`` or a tuple) simulate that many ranks
    (:mod:`torchledger.audit.world`): the step runs as rank 0 under a fake process group, after
    ``AuditSpec.parallelize(model, mesh)``; the process group is gone when this returns.

    ``schedules`` (a pipeline mesh only): compose each of these schedules from the one trace of
    the stages (the schedule changes only the composition); returns {schedule: AuditRun}.
    """
    with quiet_torch_logs(not torch_logs), _same_cwd():
        world = resolve(world_size, mesh, device)
        layout = resolve_layout(world, mesh, plan)
        if schedules is not None and (layout is None or not layout.pipelined):
            raise AuditError("schedules: several schedules from one trace need a mesh with pp")
        if world is None:
            return _run_audit(path, entry, device, steps, peak_flops, timing_steps, layout=layout)
        try:
            if layout.pipelined:
                return run_pipeline_audit(path, entry, world, layout, schedules)
            with fake_world(*world, names=layout.names) as device_mesh:
                return _run_audit(path, entry, device, steps, peak_flops, timing_steps,
                                  world=(world, device_mesh), layout=layout)
        except WorldError as e:
            raise AuditError(str(e)) from None


@contextlib.contextmanager
def _same_cwd():
    """The working directory as it was, whatever the model file did with it (``os.chdir``)."""
    cwd = os.getcwd()
    try:
        yield
    finally:
        _restore_cwd(cwd)


def _restore_cwd(cwd: str) -> None:
    with contextlib.suppress(OSError):
        if os.getcwd() != cwd:
            os.chdir(cwd)


def _run_audit(path, entry, device, steps, peak_flops, timing_steps, world=None, layout=None) -> AuditRun:
    """Load the model file, build its spec and plan on ``device``, trace ``steps`` steps, time
    untraced ones (cpu, cuda) and stamp each record with what the audit was."""
    _check_counts(steps, timing_steps)
    cwd = os.getcwd()
    fn = load_entry(path, entry)
    applied = {}
    with device_context(device):
        built = _build(fn, path, entry, device, world, layout)
        with step_kernels(layout, applied):
            ledger, loss_source, step = _trace_steps(built, steps, path, device, world, peak_flops)
            warmup = 0
            if device in ("cpu", "cuda"):       # untraced steps time the step for MFU
                warmup = time_untraced(ledger, step, timing_steps)
    built.plan_notes = [*built.plan_notes, *kernel_notes(applied)]
    _restore_cwd(cwd)                   # a model file that chdir'd: paths are the user's again
    info = {"file": os.path.relpath(path), "entry": entry, "device": device, "steps": steps,
            "seq_len": built.seq, "spec_line": spec_location(path, entry)[1],   # SARIF points here
            "loss": loss_source[0] if loss_source else None}
    for r in ledger.records:
        _stamp(r, dict(info), built, world, layout)
    run = AuditRun(ledger.records, built.spec, device, path)
    run.snapshot = ledger.snapshot
    run.untraced_seconds = list(ledger.untraced_seconds)
    run.warmup_steps = warmup
    if run.untraced_seconds:
        run.record.totals["step_seconds_untraced"] = sorted(run.untraced_seconds)[len(run.untraced_seconds) // 2]
    set_mfu(run, {"peak_flops": peak_flops})
    return run


def _check_counts(steps, timing_steps) -> None:
    if steps < 1:
        raise AuditError(f"--steps: expected a whole number >= 1, got {steps}")
    if timing_steps is not None and not (isinstance(timing_steps, int) and 0 <= timing_steps <= MAX_TIMING_STEPS):
        raise AuditError(f"--timing-steps: expected a whole number from 0 to {MAX_TIMING_STEPS}, got "
                         f"{timing_steps!r}")


class _Built(types.SimpleNamespace):
    """What the model file's spec became on the audit's device: the model under its plan, the
    inputs (rank 0's part), the optimizer, and the tokens (D) and sequence length (T)."""


def _build(fn, path, entry, device, world, layout) -> _Built:
    """Call the model file's ``entry()`` in the device context, apply the plan (the file's own
    ``parallelize`` or the standard plan of ``layout``) and make the optimizer."""
    try:
        with fake_safe_init(device):
            raw = fn()
    except AuditError:
        raise
    except USER_ERRORS as e:
        raise AuditError(f"{where(e, path)}: {entry}() {raised(e)}{device_hint(e, device)}") from None
    try:
        spec = as_spec(raw)
    except TypeError as e:
        raise AuditError(f"{path}: {entry}() must return a torchledger.AuditSpec; {e}") from None
    model = spec.model
    keep_blocks(model, layout, path)
    if device in ("meta", "cuda"):
        model = model.to(device)
    inputs = batch_part(to_device(spec.inputs, device), spec, layout)     # --micro-batch-size
    plan_notes = []
    if world is not None:
        model, plan_notes = parallelize(spec, model, world, path, layout, infer_tokens(inputs).seq_len)
        inputs = cp_part(inputs, spec, layout, world)
    elif layout is not None and spec.parallelize is None:      # --checkpointing/--precision alone
        model, plan_notes = standard_plan(model, None, layout, path)
    count = infer_tokens(inputs, model)
    try:
        opt = make_optimizer(spec.optimizer or default_optimizer(layout), model, layout)
    except USER_ERRORS as e:
        raise AuditError(f"{where(e, path)}: making the optimizer {raised(e)}") from None
    _check_optimizer(opt, spec, path)
    if device == "meta":
        opt.step = _step_with_cpu_default(opt.step)
    return _Built(spec=spec, model=model, inputs=inputs, opt=opt, plan_notes=plan_notes, count=count,
                  tokens=spec.tokens or count.tokens, source=TOKENS_FROM_SPEC if spec.tokens else count.source,
                  guessed=None if spec.tokens else tokens_warning(inputs, model),
                  seq=spec.seq_len or count.seq_len)


def _trace_steps(built: _Built, steps: int, path, device, world, peak_flops) -> tuple:
    """Trace ``steps`` training steps under a :class:`~torchledger.ledger.Ledger`; returns it,
    the loss's source (a one-item list once a step ran) and the step function."""
    ledger = Ledger(built.model, optimizer=built.opt, keep=max(steps, 1),       # every audited step
                    peak_flops=peak_flops if device in ("cpu", "cuda") else None)
    loss_source = []

    def step():
        try:
            source = _one_step(built.spec, built.model, built.inputs, built.opt)
            if not loss_source:
                loss_source.append(source)
        except AuditError:
            raise
        except USER_ERRORS as e:
            raise step_error(e, path, device, world, built.model) from None

    with _frozen_heap():
        for _ in range(steps):
            try:
                with ledger.step(tokens=built.tokens, seq_len=built.seq, tokens_source=built.source):
                    step()
            except AuditError:
                raise
            except USER_ERRORS as e:        # entering or leaving the tracer, not the step
                raise AuditError(f"{where(e, path)}: tracing the step {raised(e)}; the model "
                                 f"file changes something the tracer relies on (torch's dispatch "
                                 f"modes, module or optimizer hooks): leave torch's own classes "
                                 f"unpatched") from None
    return ledger, loss_source, step


def _stamp(r, info: dict, built: _Built, world, layout) -> None:
    """``meta.audit`` and the layout's totals on one record: what the audit was (file, entry,
    device, steps, T, loss), the plan, the simulated world (rank 0 of n) and accumulation."""
    r.meta["audit"] = info
    if built.guessed and built.guessed not in r.warnings:
        r.warnings.append(built.guessed)
    if layout is not None:
        r.meta["audit"].update(precision=layout.precision, kernels=layout.kernels)
    if built.plan_notes:
        r.meta["audit"]["plan"] = list(built.plan_notes)
    if world is not None:        # simulated: rank 0 of n (the report says so)
        (n, shape), _ = world
        r.meta["audit"].update(world_size=n, mesh=list(shape), rank=0)
        if layout is not None:
            r.meta["audit"]["mesh_dims"] = list(layout.names)
            r.totals["parallel_dims"] = dict(layout.dims)      # {"dp": 4, "tp": 8, ...}
            if built.spec.parallelize is None and layout.size("cp") > 1:  # inputs cut to T/cp (cp_part)
                r.totals["context_parallel"] = layout.size("cp")
            # the references read the mesh (context parallel: keys of the whole sequence)
            r.predictions = record_predictions(r)
        # NB: set, not defaulted: a tracer that reads the process group finds the same
        # rank and size, but no mesh unless one is current
        r.totals.update(rank=0, world_size=n, mesh=list(shape))
        if not str(r.meta.get("device") or "").startswith("fake"):
            # NB: the tracer reads the device off the first parameter, and a sharded one is
            # a DTensor (not a FakeTensor) around its fake shard; the step was fake, so no
            # MFU is read from its time
            r.meta["device"] = "fake (cpu)"
    accumulate = accumulated(layout, built.count)
    if accumulate:
        r.totals["micro_batches"] = accumulate


def set_mfu(run, options: dict) -> dict:
    """Store the report's one MFU in the last record (``analyzers.mfu.mfu_totals``), timed by
    the untraced steps when there are any; returns ``options`` with that time added."""
    options = dict(options)
    if run.untraced_seconds:
        options.update(step_seconds=run.record.totals["step_seconds_untraced"],
                       untraced_steps=len(run.untraced_seconds),
                       untraced_seconds=list(run.untraced_seconds),    # how many, their spread
                       warmup_steps=getattr(run, "warmup_steps", 0))
    run.record.totals.update(mfu_totals(run.records, options))
    return options


#: Untraced steps timed for MFU when ``timing_steps`` is None: at least AUTO_MIN_STEPS, then
#: more until they add up to AUTO_SECONDS, at most AUTO_MAX_STEPS (a 5 ms step is timed 20
#: times, a 100 ms one 5 times, a 2 s one 3 times). One untimed warm-up step runs first.
AUTO_MIN_STEPS, AUTO_MAX_STEPS, AUTO_SECONDS = 3, 20, 0.5
MAX_TIMING_STEPS = 1000
WARMUP_STEPS = 1


def time_untraced(ledger, step, timing_steps: Optional[int] = None) -> int:
    """Time untraced steps for MFU (``ledger.time_step()``, on the ledger's clock): first
    :data:`WARMUP_STEPS` untimed (caches, the allocator, a compiled model's compile: the
    traced steps ran eagerly), then ``timing_steps`` timed ones, or with None as many as the
    AUTO_* rule asks. Returns the number of warm-up steps run (0 when none is timed)."""
    if timing_steps == 0:
        return 0
    for _ in range(WARMUP_STEPS):
        step()
    times = ledger.untraced_seconds
    start, n = len(times), 0
    while True:
        if timing_steps is not None:
            if n >= timing_steps:
                break
        elif n >= AUTO_MAX_STEPS or (n >= AUTO_MIN_STEPS and sum(times[start:]) >= AUTO_SECONDS):
            break
        with ledger.time_step():
            step()
        n += 1
    return WARMUP_STEPS


def _check_optimizer(opt, spec, path: str) -> None:
    """What ``AuditSpec.optimizer(params)`` returned must be an optimizer: a
    ``torch.optim.Optimizer``, or an object with its ``param_groups``, ``state`` (a mapping),
    ``step()`` and, for the default step, ``zero_grad()``."""
    import collections.abc

    import torch
    if isinstance(opt, torch.optim.Optimizer):
        return
    needed = {"param_groups": lambda v: isinstance(v, (list, tuple)),
              "state": lambda v: isinstance(v, collections.abc.Mapping),
              "step": callable}
    if spec.step is None:
        needed["zero_grad"] = callable
    missing = [name for name, ok in needed.items() if not ok(getattr(opt, name, None))]
    if not missing:
        return
    where = path
    code = getattr(spec.optimizer, "__code__", None)
    if code is not None and os.path.abspath(code.co_filename) == os.path.abspath(path):
        where = f"{os.path.relpath(path)}:{code.co_firstlineno}"
    shown = " ".join(repr(opt).split())
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    wants = ", ".join(n + "()" if n in ("step", "zero_grad") else n for n in needed)
    raise AuditError(f"{where}: AuditSpec.optimizer(params) returned {type(opt).__name__} ({shown}), "
                     f"expected a torch.optim.Optimizer or an object with {wants} (missing: "
                     f"{', '.join(missing)}); return one, e.g. "
                     f"`optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)`")


def _step_with_cpu_default(step):
    """``optimizer.step`` with the CPU as the default device, for meta audits.

    The step runs inside ``torch.device("meta")``; an optimizer that makes a scalar with no
    device and reads it back with ``.item()`` (Adam/AdamW's ``state["step"]`` on torch 2.11
    and 2.12; 2.13 says ``device="cpu"``) fails there. State made ``*_like`` a parameter
    stays on meta either way.
    """
    import functools

    import torch

    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        with torch.device("cpu"):
            return step(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def _frozen_heap():
    """While the audited steps run, what exists before them (torch, the model file's imports,
    the model: a Hugging Face 7B build leaves ~1M objects) sits in the gc's permanent
    generation (``gc.freeze``), so a full collection the steps trigger walks only what they
    made (measured: a 0.23 s collection inside a traced 7B step). Nothing is freed that would
    not be: the heap is unfrozen when the steps end. Left alone when something else in the
    process already froze objects (its freeze is not ours to undo)."""
    import gc
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _one_step(spec, model, inputs, opt) -> str:
    """One training step; returns where its loss came from (``meta.audit.loss``)."""
    if spec.step is not None:
        spec.step(model, inputs, opt)
        return "AuditSpec.step (the model file's own step)"
    out = call_model(model, inputs)
    if spec.loss_fn is not None:
        loss, source = spec.loss_fn(out, inputs), "AuditSpec.loss_fn"
    else:
        loss, source = pick_loss(out)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return source


