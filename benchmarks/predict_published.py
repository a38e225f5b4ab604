"""Predict the step time of published, measured training runs, as the scorer does.

    PYTHONPATH=$PWD python benchmarks/predict_published.py [--today] [--only ID] [--json]
        [--timeout S] [--save DIR]

The runs are ``benchmarks/data/calibration-runs.json`` (twelve published runs, each with
its source). For each, the model file is written the way the scorer writes it (a torchledger
preset, ``TransformerConfig`` fields with ``max_seq_len`` raised to the run's sequence, or a
Hugging Face config; ``AuditSpec(model, {"idx": ids, "targets": ids}, tokens=micro_batch x
seq, seq_len=seq)`` with ids of one micro-batch), then ``torchledger audit MODEL.py <flags>``
runs in a fresh process and ``predictions.step_time.seconds`` is the step.

Error = predicted over measured tokens/s per GPU, minus 1 (tokens = global batch x seq per
step; measured from the source's step time where it gives one). ``--today`` uses each run's
``flags_today`` (the closest flags older torchledgers accepted) instead of ``flags``. A run
the tool refuses (exit 2) or that does not finish is printed as such and counted as not
predicted.

No constant of the time model is taken from these runs: they check it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_RUNS = os.path.join(HERE, "data", "calibration-runs.json")

SPEC = textwrap.dedent('''
    import torch
    import torchledger
    from torchledger.models import build_model, get_config
    from torchledger.models.config import TransformerConfig

    MODEL = {model!r}
    SEQ, MICRO = {seq!r}, {micro!r}

    def _model():
        if isinstance(MODEL, str):
            cfg = get_config(MODEL)
            cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, SEQ))
            return build_model(cfg), cfg.vocab_size
        if "hf" in MODEL:
            import transformers
            cfg = getattr(transformers, MODEL["hf"])(**MODEL["config"])
            return transformers.AutoModelForCausalLM.from_config(cfg), cfg.vocab_size
        fields = {{k: v for k, v in MODEL.items() if k != "note"}}
        fields["max_seq_len"] = max(fields.get("max_seq_len", 0), SEQ)
        cfg = TransformerConfig(**fields)
        return build_model(cfg), cfg.vocab_size

    def audit_spec():
        model, vocab = _model()
        ids = torch.randint(0, vocab, (MICRO, SEQ))
        return torchledger.AuditSpec(model, {{"idx": ids, "targets": ids}} if not hasattr(model, "config")
                                     or not hasattr(model.config, "model_type") else
                                     {{"input_ids": ids, "labels": ids}},
                                     tokens={tokens}, seq_len=SEQ)
''')


def model_file(run, models, micro=None, tokens=True) -> str:
    """The model file of ``run`` (a preset name, TransformerConfig fields or a HF config):
    inputs of ``micro`` sequences (default the run's micro-batch), ``AuditSpec(tokens=micro x
    seq)`` unless ``tokens`` is False (``torchledger plan`` resizes the batch with ``audit
    --micro-batch-size``, which a fixed token count forbids; the tokens are then read off the
    inputs, the same count)."""
    return SPEC.format(model=models[run["model"]] if models[run["model"]] != "preset" else run["model"],
                       seq=run["seq"], micro=run["micro_batch"] if micro is None else micro,
                       tokens="MICRO * SEQ" if tokens else "None")


def tokens_per_step(run) -> int:
    return int(run["global_batch"]) * int(run["seq"])


def measured_tokens_per_s_per_gpu(run) -> float:
    m = run["measured"]
    if "step_s" in m:
        return tokens_per_step(run) / float(m["step_s"]) / int(run["gpus"])
    return float(m["tokens_per_s_per_gpu"])


def audit(run, models, flags, timeout: float, save=None) -> dict:
    """Run ``torchledger audit`` on the run's model file with ``flags``; the row's result."""
    with tempfile.TemporaryDirectory(prefix="tl-published-") as tmp:
        path = os.path.join(tmp, run["id"].replace("-", "_") + ".py")
        with open(path, "w") as f:
            f.write(model_file(run, models))
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "torchledger", "audit", path, *flags, "--output", out],
                                  capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            return {"status": f"no result in {timeout:.0f} s"}
        secs = time.perf_counter() - t0
        if proc.returncode not in (0, 1) or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["?"]
            return {"status": f"exit {proc.returncode}: {tail[0][:200]}", "audit_s": secs}
        with open(out) as f:
            rec = json.load(f)
        if save:
            os.makedirs(save, exist_ok=True)
            with open(os.path.join(save, run["id"] + ".json"), "w") as f:
                json.dump(rec, f)
    st = (rec.get("predictions") or {}).get("step_time") or {}
    if not st.get("seconds"):
        return {"status": "no predicted step time: " + "; ".join(rec.get("warnings") or [])[:200], "audit_s": secs}
    return {"status": "ok", "predicted_s": st["seconds"], "mfu_predicted": st.get("mfu"), "bound": st.get("bound"),
            "audit_s": secs, "assumptions": st.get("assumptions")}


def predict(run, models, today=False, timeout=1800.0, save=None) -> dict:
    flags = run["flags_today" if today else "flags"]
    row = {"id": run["id"], "gpu": run["gpu"], "flags": " ".join(flags)}
    row.update(audit(run, models, flags, timeout, save))
    measured = measured_tokens_per_s_per_gpu(run)
    row["measured_tokens_per_s_per_gpu"] = measured
    row["measured_s"] = tokens_per_step(run) / measured / int(run["gpus"])
    if row["status"] == "ok":
        predicted = tokens_per_step(run) / row["predicted_s"] / int(run["gpus"])
        row["predicted_tokens_per_s_per_gpu"] = predicted
        row["error"] = predicted / measured - 1
    return row


# -- the fit: global parameters of the time model against these runs, with leave-one-out ----
#: The fitted parameter (formulas/steptime.py DEFAULT_EFFICIENCY) and its grid. overlap_slowdown
#: is held at its default: its figure comes from NCCL's SM share, and the runs do not pin it
#: (fitted together, the fits without each run scattered it over 0 to 0.30).
GRID = [round(0.60 + 0.01 * i, 2) for i in range(41)]      # sustained_fraction


def reprice(saved: str, runs, models):
    """{run id: {s: predicted tokens/s per GPU}} over GRID, from the records --save wrote
    (each re-priced by analyzers.steptime with the parameters replaced, nothing re-traced).
    NB: a pipeline run is re-priced on its saved (bounding) stage, scaled by the ratio its
    audit found between the slowest stage and that one."""
    import dataclasses
    from torchledger.steptime.predict import predict_step_time
    from torchledger.formulas.hardware import get_gpu
    from torchledger.record import StepRecord
    table = {}
    for run in runs:
        path = os.path.join(saved, run["id"] + ".json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        rec = StepRecord.from_dict(d)
        st = d["predictions"]["step_time"]
        gpu = get_gpu(st["gpu"])
        kw = {"micro_batches": st.get("micro_batches")}
        base = predict_step_time(rec, gpu, kw)["seconds"]
        ratio = st["seconds"] / base if base else 1.0
        table[run["id"]] = {}
        for s in GRID:
            part = dataclasses.replace(gpu, efficiency={**gpu.efficiency, "sustained_fraction": s})
            secs = predict_step_time(rec, part, kw)["seconds"] * ratio
            table[run["id"]][s] = tokens_per_step(run) / secs / int(run["gpus"])
    return table


def _loss(table, runs, point) -> float:
    import math
    errs = [abs(math.log(table[r["id"]][point] / measured_tokens_per_s_per_gpu(r))) for r in runs]
    return sum(errs) / len(errs)


def fit(table, runs) -> tuple:
    """The grid point with the least mean |log error| over ``runs``."""
    runs = [r for r in runs if r["id"] in table]
    points = list(next(iter(table.values())))
    return min(points, key=lambda pt: (_loss(table, runs, pt), pt))


def fit_report(table, runs) -> list:
    """Rows: each run's error at the fit on all runs (in-sample) and at the fit on the others
    (leave-one-out), and the fitted point of each."""
    runs = [r for r in runs if r["id"] in table]
    best = fit(table, runs)
    rows = []
    for r in runs:
        others = [o for o in runs if o is not r]
        loo = fit(table, others)
        meas = measured_tokens_per_s_per_gpu(r)
        rows.append({"id": r["id"], "in_sample": table[r["id"]][best] / meas - 1,
                     "leave_one_out": table[r["id"]][loo] / meas - 1, "loo_fit": loo})
    return [best, rows]


def summary(rows) -> str:
    errs = sorted(abs(r["error"]) for r in rows if "error" in r)
    missing = sum(1 for r in rows if "error" not in r)
    if not errs:
        return f"no run predicted ({missing} refused or failed)"
    mid = errs[len(errs) // 2] if len(errs) % 2 else (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2
    return (f"median |error| {100 * mid:.1f}%, worst {100 * errs[-1]:.1f}% over {len(errs)} runs"
            + (f"; {missing} not predicted" if missing else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--only", default=None, help="run ids, comma-separated")
    ap.add_argument("--today", action="store_true", help="each run's flags_today instead of its flags")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per audit")
    ap.add_argument("--save", default=None, help="write each run's record here")
    ap.add_argument("--fit", default=None, metavar="DIR",
                    help="fit sustained_fraction to the records a --save run wrote in DIR (overlap_slowdown "
                         "held at its default); print each run's in-sample and leave-one-out error")
    args = ap.parse_args(argv)
    with open(args.runs) as f:
        data = json.load(f)
    only = set(args.only.split(",")) if args.only else None
    if args.fit:
        return print_fit(args.fit, [r for r in data["runs"] if not only or r["id"] in only], data["models"])
    rows = []
    for run in data["runs"]:
        if only and run["id"] not in only:
            continue
        r = predict(run, data["models"], args.today, args.timeout, args.save)
        rows.append(r)
        if not args.json:
            if "error" in r:
                print(f"{r['id']:30s} predicted {r['predicted_tokens_per_s_per_gpu']:9,.0f} tok/s/GPU  measured "
                      f"{r['measured_tokens_per_s_per_gpu']:9,.0f}  error {100 * r['error']:+6.1f}%  "
                      f"(step {r['predicted_s']:.3f} s vs {r['measured_s']:.3f} s; audit {r['audit_s']:.0f} s)",
                      flush=True)
                print(f"{'':30s} {r['bound']}", flush=True)
            else:
                print(f"{r['id']:30s} NOT PREDICTED: {r['status']}", flush=True)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
    else:
        print(summary(rows))
    return 0


def print_fit(saved, runs, models) -> int:
    table = reprice(saved, runs, models)
    if not table:
        print(f"no saved records in {saved}: run with --save {saved} first")
        return 2
    best, rows = fit_report(table, runs)
    from torchledger.formulas.steptime import DEFAULT_EFFICIENCY
    print(f"fit on {len(rows)} runs: sustained_fraction {best:.2f}, overlap_slowdown "
          f"{DEFAULT_EFFICIENCY['overlap_slowdown']:.2f} (held)")
    print(f"{'run':30s} {'in-sample':>10s} {'leave-one-out':>14s}  (fit without it)")
    for r in rows:
        print(f"{r['id']:30s} {100 * r['in_sample']:+9.1f}% {100 * r['leave_one_out']:+13.1f}%  "
              f"({r['loo_fit']:.2f})")
    for key in ("in_sample", "leave_one_out"):
        errs = sorted(abs(r[key]) for r in rows)
        mid = errs[len(errs) // 2] if len(errs) % 2 else (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2
        print(f"{key.replace('_', '-')}: median |error| {100 * mid:.1f}%, worst {100 * errs[-1]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
