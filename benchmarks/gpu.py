"""GPU benchmark: predicted peak memory (fake tensors) against measured, and measured MFU.

    PYTHONPATH=. python3 benchmarks/gpu.py --out DIR       (on a machine with a CUDA GPU)

For gpt-mini (batch 8 x 512) and the gpt2 preset (batch 8 x 1024), AdamW (foreach) and bf16
autocast on CUDA:

(a) predicted: the model, optimizer and batch are built under FakeTensorMode on a fake CUDA
    device and two steps are traced with torchledger (no real memory, no kernels);
    ``totals.peak_bytes`` of each step is the prediction.
(b) measured: after a throwaway warm-up step (cuBLAS workspaces, kernels), a fresh model runs
    the same two steps; before each, ``torch.cuda.reset_peak_memory_stats()``; after,
    ``torch.cuda.max_memory_allocated()``. Memory allocated before the step that the model
    does not own (the batch, cuBLAS workspaces: ``unowned_bytes``) is subtracted, so
    ``measured_step_peak_bytes`` counts what the tracer counts. Goal: within 5%.
(c) MFU: ``--steps`` timed steps after warm-up, timed with CUDA events; model FLOPs per step
    from the record's ``totals.flops.total``; peak bf16 FLOP/s from the hardware table by
    ``torch.cuda.get_device_name()`` (``--peak-flops`` overrides; an SXM part is assumed).

Results: DIR/gpu-bench.json and a short table on stdout. Without CUDA: one line, exit 0.
Only stdlib, torch, numpy, pandas, tabulate and click; runs from source on torch 2.4+.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchledger  # noqa: E402
from torchledger.models import build_model, example_inputs  # noqa: E402

CASES = [("gpt-mini", 8, 512), ("gpt2", 8, 1024)]
DTYPE = torch.bfloat16


def step(model, opt, inputs):
    with torch.autocast("cuda", dtype=DTYPE):
        loss = model(**inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def build(name, batch, seq):
    torch.manual_seed(0)
    model = build_model(name, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt, example_inputs(name, batch=batch, seq_len=seq, device="cuda")


def predict(name, batch, seq, steps=2):
    """Trace ``steps`` steps on fake CUDA tensors; the records (plain data) come back."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, opt, inputs = build(name, batch, seq)
        ledger = torchledger.Ledger(model, optimizer=opt)
        for _ in range(steps):
            with ledger.step(tokens=batch * seq):
                step(model, opt, inputs)
    return ledger.records


def static_bytes(model, opt) -> int:
    """Bytes the model and optimizer own before a step: parameters, buffers, gradients, state."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if t.is_cuda and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def measure(name, batch, seq, steps=2) -> list:
    model, opt, inputs = build(name, batch, seq)
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        owned = static_bytes(model, opt)
        torch.cuda.reset_peak_memory_stats()
        step(model, opt, inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.append({"measured_peak_bytes": peak, "allocated_before_bytes": before,
                    "unowned_bytes": before - owned, "measured_step_peak_bytes": peak - (before - owned)})
    del model, opt, inputs
    return out


def time_steps(name, batch, seq, n) -> float:
    model, opt, inputs = build(name, batch, seq)
    for _ in range(3):
        step(model, opt, inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step(model, opt, inputs)
    end.record()
    end.synchronize()                     # NB: the one CPU-GPU sync of the timed loop
    return start.elapsed_time(end) / 1e3 / n


def peak_flops(override):
    from torchledger.formulas.hardware import get_gpu
    if override:
        return override, "--peak-flops"
    name = torch.cuda.get_device_name()
    for candidate in [name] + re.findall(r"[A-Z]\d{2,3}", name):
        try:
            return get_gpu(candidate).peak("bf16"), f"{get_gpu(candidate).name} (from {name!r})"
        except ValueError:
            continue
    return None, f"{name!r} is not in the hardware table: pass --peak-flops"


def warm_up():
    """A throwaway step so cuBLAS workspaces and kernels exist before anything is measured."""
    model, opt, inputs = build("gpt-mini", 2, 64)
    for _ in range(2):
        step(model, opt, inputs)
    del model, opt, inputs
    clear()


def clear():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_case(name, batch, seq, n_timed, peak) -> dict:
    t0 = time.perf_counter()
    records = predict(name, batch, seq)
    measured = measure(name, batch, seq)
    clear()
    rows = []
    for k, (rec, m) in enumerate(zip(records, measured)):
        pred = rec.totals["peak_bytes"]
        rows.append({"step": k + 1, "predicted_peak_bytes": pred, **m,
                     "error": pred / m["measured_step_peak_bytes"] - 1,
                     "predicted_peak_phase": rec.totals.get("peak_phase"),
                     "predicted_peak_module": rec.totals.get("peak_module")})
    seconds = time_steps(name, batch, seq, n_timed)
    clear()
    flops = records[-1].totals["flops"]["total"]
    return {"model": name, "batch": batch, "seq_len": seq, "dtype": "bf16 autocast", "optimizer": "AdamW foreach",
            "params": records[-1].totals["params"], "steps": rows, "step_seconds": seconds,
            "model_flops_per_step": flops, "flops_6nd": records[-1].predictions.get("flops_6nd"),
            "achieved_flops_per_s": flops / seconds, "mfu": flops / seconds / peak if peak else None,
            "attention_kernels": records[-1].meta.get("attention_kernels"),
            "wall_seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for gpu-bench.json")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model for MFU")
    ap.add_argument("--peak-flops", type=float, default=None, help="peak bf16 FLOP/s of this GPU")
    ap.add_argument("--models", default=",".join(c[0] for c in CASES), help="comma-separated subset")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: skipping")
        return 0
    from tabulate import tabulate
    peak, peak_from = peak_flops(args.peak_flops)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "peak_flops_bf16": peak, "peak_flops_source": peak_from, "goal": "|error| <= 0.05", "cases": []}
    warm_up()
    for name, batch, seq in CASES:
        if name not in args.models.split(","):
            continue
        try:
            result["cases"].append(run_case(name, batch, seq, args.steps, peak))
        except Exception as e:            # one failing case must not hide the other's numbers
            result["cases"].append({"model": name, "error": f"{type(e).__name__}: {e}"})
            clear()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu-bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    gib = 2**30
    table = [[c["model"], s["step"], f"{s['predicted_peak_bytes'] / gib:.3f}",
              f"{s['measured_step_peak_bytes'] / gib:.3f}", f"{s['measured_peak_bytes'] / gib:.3f}",
              f"{s['error']:+.2%}", f"{c['step_seconds'] * 1e3:.1f}",
              f"{c['mfu']:.1%}" if c.get("mfu") is not None else "-"]
             for c in result["cases"] if "steps" in c for s in c["steps"]]
    print(f"{result['device']}, torch {result['torch']}, peak bf16 {peak_from}")
    print(tabulate(table, headers=["model", "step", "predicted GiB", "measured GiB", "raw max GiB",
                                   "error", "ms/step", "MFU"]))
    for c in result["cases"]:
        if "steps" not in c:
            print(f"{c['model']}: FAILED {c['error']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
