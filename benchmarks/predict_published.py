"""Predict the step time of the published, measured runs in ../shared/calibration-runs.json
(a check of the step-time model, never a fit: no constant here is taken from these runs).

    PYTHONPATH=$PWD python benchmarks/predict_published.py [--runs PATH] [--json]

Each run's model is built from torchledger's presets (or the hyperparameters the file gives),
traced on fake tensors at the run's layout under a simulated world (``run_audit`` with the
run's named ``--mesh`` and torchledger's standard plan: the one ``torchledger audit FILE
--mesh ... --precision ... --checkpointing ...`` applies), and priced with
``analyzers.steptime`` on the run's part. What each row takes as given:

* kor-22b-tp8: ``--mesh tp=8`` (column/row split per block; the model has learned positions,
  so no sequence parallelism: the plan says so), ``--precision bf16`` standing for Megatron's
  fp16 mixed precision (16-bit weights and activations, the same A100 peak; without FSDP the
  "-mixed" options are autocast, which casts fp32 weights at every matmul instead). Selective
  recompute (Korthikanti: only the attention core) is a no-op with a fused attention kernel:
  traced without recompute.
* tt-l3-8b-a100-64: ``--mesh dp=64`` (FSDP2), ``--precision bf16-mixed``,
  ``--checkpointing selective-op`` (torchtitan's policy).
* dgxc-l31-8b-h100-8: ``--mesh dp=4,cp=2`` (FSDP2 over dp stands for NeMo's distributed
  optimizer: the same reduce-scatter + all-gather bytes), ``--precision bf16-mixed``, 32
  micro-batches of 1 per data-parallel rank (global batch 128 / dp 4), each rank a half of
  every sequence (context parallel, K/V all-gathered over cp; its attention priced as the
  load-balanced causal ring, ``analyzers.steptime.op_seconds``). NeMo runs Transformer Engine's
  fused kernels (RMSNorm, RoPE, SwiGLU, cross-entropy): priced as ``--compiled`` (elementwise
  chains fused), a fact of the framework, not a fit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# ../shared/ beside the repository (this file is benchmarks/predict_published.py)
DEFAULT_RUNS = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "calibration-runs.json"))

SPEC = textwrap.dedent('''
    import torch
    import torchledger
    from torchledger.models import build_model, get_config
    from torchledger.models.config import TransformerConfig

    MODEL = {model!r}
    LAYOUT = {layout!r}

    def _config():
        if isinstance(MODEL, dict):
            return TransformerConfig(**{{k: v for k, v in MODEL.items()}}, max_seq_len=LAYOUT["seq"])
        return get_config(MODEL)

    def audit_spec():
        cfg = _config()
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (LAYOUT["micro_batch"], LAYOUT["seq"]))
        return torchledger.AuditSpec(model, {{"idx": idx, "targets": idx}})
''')

SAVE = None
GPUS = {"A100 SXM 80GB": "A100 SXM", "H100 SXM": "H100 SXM"}


def layout(run) -> tuple:
    """(layout dict for the spec, --mesh, plan options, micro-batches per step, tokens per GPU
    per step, note)."""
    seq, mb = run["seq"], run["micro_batch"]
    dp, tp, cp = run.get("dp", 1), run.get("tp", 1), run.get("cp", 1)
    micro = run["global_batch"] // (mb * dp)
    fp16 = "fp16" in str(run.get("precision", ""))
    # Megatron's fp16 mixed precision keeps 16-bit weights (and an fp32 master copy in the
    # optimizer): the standard plan's 16-bit parameters ("bf16": the same A100 peak and bytes)
    # without FSDP, where autocast would cast fp32 weights at every matmul instead
    plan = {"precision": "bf16" if fp16 and dp == 1 else "bf16-mixed"}
    if str(run.get("ac", "none")) == "selective-op":
        plan["checkpointing"] = "selective-op"
    if micro > 1:
        plan["micro_batches"] = micro
    dims = [f"dp={dp}"] if dp > 1 else []
    dims += [f"cp={cp}"] if cp > 1 else []
    dims += [f"tp={tp}"] if tp > 1 else []
    mesh = ",".join(dims)
    # tokens one GPU processes per step: its share of each micro-batch's sequences
    tokens = seq * mb * micro // (cp * tp) * tp          # TP ranks see every token of their batch
    compiled = "nemo" in run.get("source", "").lower()
    note = (f"--mesh {mesh}, {plan['precision']}" + (f", {plan['checkpointing']}" if "checkpointing" in plan else "")
            + (f", {micro} micro-batches" if micro > 1 else "")
            + ("; NeMo's Transformer Engine fused norm/RoPE/SwiGLU priced as --compiled" if compiled else ""))
    spec = {"seq": seq, "micro_batch": mb}
    return spec, mesh, plan, micro, tokens, compiled, note


def measured_step(run, tokens_per_gpu) -> float:
    m = run["measured"]
    if "step_s" in m:
        return float(m["step_s"])
    return tokens_per_gpu / float(m["tokens_per_s_per_gpu"])


def predict(run, models) -> dict:
    from torchledger.audit import run_audit
    from torchledger.analyzers.steptime import attach_step_time
    spec_layout, mesh, plan, micro, tokens, compiled, note = layout(run)
    model = models[run["model"]]
    model = run["model"] if model == "preset" else dict(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{run['id'].replace('-', '_')}.py")
        with open(path, "w") as f:
            f.write(SPEC.format(model=model, layout=spec_layout))
        t0 = time.perf_counter()
        result = run_audit(path, steps=1, mesh=mesh, plan=plan)
        audit_s = time.perf_counter() - t0
    rec = result.record
    pred = attach_step_time(rec, GPUS[run["gpu"]], {"micro_batches": micro, "compiled": compiled})
    if SAVE:
        rec.save(os.path.join(SAVE, run["id"] + ".json"))
    measured = measured_step(run, tokens)
    return {"id": run["id"], "gpu": pred["gpu"], "layout": note, "micro_batches": micro,
            "predicted_s": pred["seconds"], "measured_s": measured,
            "error": pred["seconds"] / measured - 1, "mfu_predicted": pred["mfu"],
            "mfu_published": run["measured"].get("mfu"), "bound": pred["bound"], "audit_s": audit_s,
            "tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--only", default=None, help="one run id")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", default=None, help="write each run's record (with its prediction) here")
    args = ap.parse_args(argv)
    global SAVE
    SAVE = args.save
    with open(args.runs) as f:
        data = json.load(f)
    rows = []
    for run in data["runs"]:
        if args.only and run["id"] != args.only:
            continue
        rows.append(predict(run, data["models"]))
        if not args.json:
            r = rows[-1]
            print(f"{r['id']:20s} {r['gpu']:9s} predicted {r['predicted_s']:7.3f} s  measured {r['measured_s']:7.3f} s  "
                  f"error {100 * r['error']:+6.1f}%  MFU pred {r['mfu_predicted']:.3f} / published "
                  f"{r['mfu_published']}  ({r['layout']}; audit {r['audit_s']:.0f} s)", flush=True)
            print(f"{'':20s} where the time goes: {r['bound']}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        errs = sorted(abs(r["error"]) for r in rows)
        if errs:
            print(f"median |error| {100 * errs[len(errs) // 2]:.1f}%, worst {100 * errs[-1]:.1f}% over {len(errs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
