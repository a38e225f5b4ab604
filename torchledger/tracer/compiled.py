"""How the traced step's code ran: ``torch.compile`` and autocast.

**torch.compile.** dynamo does not trace under a Python dispatch mode (the tracer's): it runs
the frame eagerly and marks it to be skipped, so a compiled model whose first call ran under
the tracer never compiles again (measured on torch 2.13: ``CompileCounter.frame_count`` stays
0 for every later untraced step). The traced step therefore runs under
``torch.compiler.set_stance("force_eager")``: dynamo is not consulted at all, its cache is
neither filled nor poisoned, and the untraced steps before and after run compiled as they
would without the tracer. The record says so (``meta.compiled``) and so does every report:
the traced step's numbers describe the eager step (same FLOPs; fusion changes time and
temporaries, not the matmul-class work counted here).

Detected: an ``OptimizedModule`` (``torch.compile(model)``: traced as its original module, so
module names carry no ``_orig_mod.`` prefix), modules compiled in place (``module.compile()``),
and calls of compiled code during the step (compiled functions included) where dynamo's
internals allow counting them.

**autocast.** The dtype the step computes in is not the parameters' under ``torch.autocast``;
forward pre-hooks on the model and (global) on every module note the autocast state of the
first module call made under autocast (``meta.autocast``: device type and dtype) for the
report's header: autocast around the step (Lightning's bf16-mixed, a hand-written
``with torch.autocast``) or entered inside the model's forward (accelerate wraps
``model.forward`` in it, so a ``Trainer(bf16=True)`` step is seen at its first submodule).

Known limitations: the traced step computes with eager kernels, so with a backend whose
kernels round differently (inductor) its results differ from a compiled step's in the last
bits (measured: ``examples/nanogpt_loop.py``, 20 steps tracing one in 4, weights within
3.9e-6 of a never-traced run, 5 of 20 losses 1-2 ulp apart; with ``eager``/``aot_eager``
backends and without compile, bitwise equal). A step that calls ``torch.compile`` itself
inside the traced block compiles nothing until an untraced step; autocast entered inside a
forward that then calls no module (raw ``F.linear`` on its parameters) is not seen.
"""
from __future__ import annotations

import warnings

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

__all__ = ["observe_run", "note_run"]


def _unwrap(model) -> tuple:
    """``(module to trace, names of compiled modules)``: ``(root)`` for an ``OptimizedModule``
    or a model compiled in place, else the ``named_modules()`` name of the original module."""
    names = []
    while _is_optimized(model):
        names, model = ["(root)"], model._orig_mod
    for name, mod in model.named_modules():
        if _is_optimized(mod) or getattr(mod, "_compiled_call_impl", None) is not None:
            if (name or "(root)") not in names:
                names.append(name or "(root)")
    return model, names


def _is_optimized(mod) -> bool:
    return type(mod).__name__ == "OptimizedModule" and hasattr(mod, "_orig_mod")


def observe_run(tracer, model, stack, undo=None):
    """Install, on ``stack``, eager mode for compiled code and the autocast probe; returns the
    module to trace (an ``OptimizedModule``'s original module). Never raises: what cannot be
    installed is noted in the tracer's warnings. ``undo`` (the lifecycle's ``list.append``)
    takes the probe's removal with no Python call between registering and noting it, so a
    Ctrl-C cannot leave the hook behind."""
    info = tracer.run_info = {"compiled_modules": [], "compiled_calls": 0, "autocast": None}
    try:
        model, info["compiled_modules"] = _unwrap(model)
        _force_eager(info, stack, undo)
        # our global module hooks make an OptimizedModule warn that they fire twice; they are
        # ours and fire harmlessly on the wrapper (it is not in the traced tree)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        probe = _autocast_probe(info, getattr(tracer, "_ours", None))
        handle = model.register_forward_pre_hook(probe)
        (undo or stack.callback)(handle.remove)
        # autocast entered inside the model's forward (accelerate wraps ``model.forward`` in it:
        # a Trainer(bf16=True) step) is on by the time its first submodule runs
        handle = register_module_forward_pre_hook(probe)
        (undo or stack.callback)(handle.remove)
    except Exception as e:  # noqa: BLE001  (the step must run even if dynamo changed)
        tracer._warn(f"torch.compile/autocast probe: {type(e).__name__}: {e}")
    return model


def _force_eager(info, stack, undo=None) -> None:
    """The traced step runs eagerly (``set_stance("force_eager")``) and counts the compiled
    calls it skips. Each undo is registered before its change (on ``undo``, the lifecycle's
    list, which keeps an interrupted undo to run again, else on ``stack``): a Ctrl-C between
    the two leaves an undo with nothing to do, never a change nobody undoes (it left the
    process's torch.compile forced eager: nothing compiled again after an interrupted trace)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:                  # torch < 2.6: nothing to protect the cache with
        info["unprotected"] = True
        return
    register = undo or stack.callback
    try:
        from torch._dynamo import eval_frame
    except Exception:  # noqa: BLE001
        eval_frame = None
    setter, prior = getattr(eval_frame, "_set_stance", None), getattr(eval_frame, "_stance", None)
    if setter is not None and prior is not None:
        register(lambda: eval_frame._stance is prior or setter(prior))
        set_stance("force_eager")           # a plain call sets it; the undo above puts back ``prior``
    else:                                   # another torch: its context manager
        stack.enter_context(set_stance("force_eager"))
    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None:
        return
    # Dynamo asks ``_callback_from_stance(callback)`` on each entry into compiled code (the
    # callback then is the compiler) and into each function it keeps out of compilation (False
    # or None: FakeTensorMode's ``__torch_dispatch__`` is one, so a fake step asks ~25,000
    # times); under force_eager the answer is None whatever it is given. ``list.append`` gives
    # that answer from C, no Python frame per call, and keeps what it was given: the compiled
    # entries are counted once, when the stance is put back. (A step that sets another stance
    # inside the trace still runs eagerly.)
    entries: list = []
    hook = entries.append

    def restore():
        if eval_frame._callback_from_stance is hook:
            eval_frame._callback_from_stance = original
        if entries:                     # the entries into compiled code: callbacks not False/None
            info["compiled_calls"] += len(entries) - entries.count(None) - entries.count(False)
            entries.clear()
    register(restore)
    eval_frame._callback_from_stance = hook


def _autocast_probe(info, ours=None):
    """A forward pre-hook that notes the autocast state of the first module call made under
    autocast (on the step's own threads: ``ours``), on the device of the module's weights."""
    def probe(module, args):
        try:
            if info["autocast"] is not None or (ours is not None and not ours()):
                return
            p = next(module.parameters(), None)
            device = p.device.type if p is not None else "cpu"
            if device in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                info["autocast"] = {"device_type": device, "dtype": str(dtype).replace("torch.", "")}
        except Exception:  # noqa: BLE001  (a probe never raises into the step)
            pass
    return probe


def note_run(tracer) -> None:
    """Copy what :func:`observe_run` saw into the finished record's meta (``compiled``,
    ``autocast``); a no-op when there is no record or nothing to say."""
    rec, info = getattr(tracer, "record", None), getattr(tracer, "run_info", None)
    if rec is None or not info:
        return
    if info["compiled_modules"] or info["compiled_calls"]:
        rec.meta["compiled"] = {
            "modules": info["compiled_modules"], "calls": info["compiled_calls"], "traced_step": "eager",
            "note": ("the traced step ran eagerly (torch.compile stance force_eager): dynamo's "
                     "cache untouched, untraced steps run compiled" if not info.get("unprotected") else
                     "the traced step ran eagerly and torch < 2.6 cannot keep dynamo's cache out of "
                     "it: code first called under the trace may not compile later")}
    if info["autocast"]:
        rec.meta["autocast"] = info["autocast"]
