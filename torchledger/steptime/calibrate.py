"""Fit a part's kernel efficiency parameters to measured step times (``torchledger calibrate``).

``fit_efficiency(records, gpu)`` takes records of real steps on that part (``audit --device
cuda`` or ``trace`` on a GPU, with ``totals.step_seconds``), predicts each with
:func:`~torchledger.steptime.predict.predict_step_time` and adjusts the parameters that
set compute time so that the predictions meet the measurements: the sum over records of
``log(predicted / measured)^2`` is minimised by coordinate descent (golden-section search on
each parameter in log space, within physical bounds), sweeping until no parameter moves.

Fitted, with their bounds:

* ``matmul_peak_fraction`` (0.05-1): large GEMMs' fraction of the dense peak;
* ``memory_fraction`` (0.05-1): elementwise kernels' fraction of HBM bandwidth;
* ``launch_s`` (0.5-100 us): the per-kernel floor;
* ``attention_scale`` (0.1-3): multiplies the part's attention fractions (forward and
  backward) of its default kernel.

The fit is of whole measured steps, so the fractions it writes are sustained ones: the row
sets ``sustained_fraction`` to 1 (the default derates single-kernel figures instead).

A parameter the records cannot see (no attention in any of them, no launch-bound op) keeps
its value (the search finds a flat objective and stays put). A parameter the search drove to
one of its bounds (``at_bounds``) did not fit: the records ask for a part faster or slower
than any physical setting (records of another GPU, a step time that includes data loading);
the caller writes it with a warning naming the parameter and the bound. More varied records (large and
small matmuls, long and short sequences) pin more of them; one record pins at most a blend.

Known limitations: collective constants are not fitted (use ``nccl-tests`` figures in the
part's ``nvlink``/``nic`` fields); the fit reads step times only, not per-kernel times.
"""
from __future__ import annotations

import math

from ..formulas import steptime as st
from ..formulas.hardware import get_gpu
from .predict import predict_step_time

__all__ = ["fit_efficiency", "measured_seconds", "FITTED", "AT_BOUND"]

#: name -> (low, high) bounds of each fitted parameter
FITTED = {"matmul_peak_fraction": (0.05, 1.0), "memory_fraction": (0.05, 1.0), "launch_s": (0.5e-6, 100e-6),
          "attention_scale": (0.1, 3.0)}
_GOLDEN = (math.sqrt(5) - 1) / 2
#: A fitted value within this fraction of its bounds' log range from a bound is at that bound.
AT_BOUND = 1e-3


def measured_seconds(rec):
    """The measured step time of a record (untraced steps first), or None."""
    t = rec.totals
    return t.get("step_seconds_untraced") or t.get("step_seconds")


def _apply(base: dict, params: dict) -> dict:
    eff = dict(base)
    for k, v in params.items():
        if k == "attention_scale":
            eff["attention"] = {name: [min(f * v, 1.0) for f in fr] for name, fr in base["attention"].items()}
        else:
            eff[k] = v
    return eff


def fit_efficiency(records, gpu, options=None, sweeps: int = 6, steps: int = 40, progress=None) -> dict:
    """``{"efficiency": {...fitted values...}, "rms_log_error": before/after, "records": n,
    "at_bounds": [...]}``.

    ``efficiency`` holds the part's ``efficiency`` row to write into ``TORCHLEDGER_HARDWARE``
    (``attention`` as the scaled fractions). ``at_bounds`` lists the parameters the search moved
    onto a bound of ``FITTED``: ``{"name", "value", "bound": "lower"|"upper"}``.
    ``progress(sweep, sweeps, rms_log_error)``, if given, is called after each sweep."""
    from dataclasses import replace

    gpu = get_gpu(gpu)
    # measured steps hold what a sustained training step loses: the fitted fractions are the
    # step's own, so the row carries no further sustained derate
    base = dict(st.efficiency(gpu), sustained_fraction=1.0)
    pairs = [(r, measured_seconds(r)) for r in records]
    pairs = [(r, m) for r, m in pairs if m]
    if not pairs:
        raise ValueError("no record has a measured step time (totals.step_seconds)")
    opts = dict(options or {})

    def loss(params):
        part = replace(gpu, efficiency=_apply(base, params))
        total = 0.0
        for rec, meas in pairs:
            pred = predict_step_time(rec, part, opts)["seconds"]
            total += math.log(max(pred, 1e-12) / meas) ** 2
        return total

    params = {"matmul_peak_fraction": float(base["matmul_peak_fraction"]),
              "memory_fraction": float(base["memory_fraction"]), "launch_s": float(base["launch_s"]),
              "attention_scale": 1.0}
    start = loss(params)
    best = start
    first = dict(params)
    for sweep in range(sweeps):
        moved = False
        for name, (lo, hi) in FITTED.items():
            a, b = math.log(lo), math.log(hi)

            def f(x):
                return loss({**params, name: math.exp(x)})
            c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
            fc, fd = f(c), f(d)
            for _ in range(steps):
                if fc < fd:
                    b, d, fd = d, c, fc
                    c = b - _GOLDEN * (b - a)
                    fc = f(c)
                else:
                    a, c, fc = c, d, fd
                    d = a + _GOLDEN * (b - a)
                    fd = f(d)
            x = (a + b) / 2
            value = loss({**params, name: math.exp(x)})
            if value < best - 1e-12 * max(best, 1.0):
                if abs(math.exp(x) - params[name]) > 1e-9 * params[name]:
                    moved = True
                params[name], best = math.exp(x), value
        if progress is not None:
            progress(sweep + 1, sweeps, math.sqrt(best / len(pairs)))
        if not moved:
            break
    eff = _apply(base, params)
    row = {k: eff[k] for k in ("matmul_peak_fraction", "memory_fraction", "launch_s", "sustained_fraction")}
    row["attention"] = eff["attention"]
    n = len(pairs)
    return {"efficiency": row, "attention_scale": params["attention_scale"], "records": n,
            "rms_log_error_before": math.sqrt(start / n), "rms_log_error_after": math.sqrt(best / n),
            "at_bounds": at_bounds(params, first)}


def at_bounds(params: dict, start: dict) -> list:
    """The parameters a fit moved (from ``start``) onto one of their ``FITTED`` bounds."""
    out = []
    for name, (lo, hi) in FITTED.items():
        value = params[name]
        if value == start[name]:
            continue                    # kept: the records do not see it
        span = math.log(hi) - math.log(lo)
        for bound, limit in (("lower", lo), ("upper", hi)):
            if abs(math.log(value) - math.log(limit)) <= AT_BOUND * span:
                out.append({"name": name, "value": value, "bound": bound, "limit": limit})
    return out
