"""GPU check: a bundled example audited on this machine's GPU, beside the laptop's prediction.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py [EXAMPLE.py] [--gpu NAME] [--out DIR]
        [-- AUDIT FLAGS...]

Two runs of ``torchledger audit`` on the same model file (default ``examples/gpt2.py``, flags
``--precision bf16-mixed --steps 2``), each in a fresh process:

(a) predicted, as on a laptop: fake tensors (``--device fake``, the default) and ``--gpu NAME``:
    the traced step's peak bytes (``totals.peak_bytes``) and the predicted step time and MFU
    (``predictions.step_time``);
(b) measured: ``--device cuda --gpu NAME``, the real step on this GPU: the tracer's peak of the
    same step (``totals.peak_bytes``), the allocator's high-water mark
    (``torch.cuda.max_memory_allocated`` at the step's end, ``memory.cuda``: it also holds the
    inputs and cuBLAS workspaces), the median of the untraced steps after the traced ones
    (``totals.step_seconds``) and the MFU at that time.

Both MFUs are model FLOPs over seconds over the same peak: the prediction's own (the part's
dense peak at the step's matmul dtype). The measured one is the CUDA record's predicted MFU x
its predicted seconds / its measured seconds (``predictions.step_time.measured_seconds``).

NAME defaults to ``torch.cuda.get_device_name()`` looked up in torchledger's hardware table.
Without a CUDA device: one line and exit 2 (nothing was checked); a part the table does not
know, or an audit that fails: one line naming it and exit 2. Results: DIR/gpu-check.json
(DIR: ``--out``, default a new temporary folder) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_EXAMPLE = os.path.join("examples", "gpt2.py")
DEFAULT_FLAGS = ["--precision", "bf16-mixed", "--steps", "2"]


class CheckError(Exception):
    """One line for the user; exit 2."""


def audit(example: str, flags: list, out_json: str, timeout: float = 900) -> dict:
    """``torchledger audit EXAMPLE FLAGS --format json --output OUT_JSON`` in a fresh process;
    the record it wrote. Exit 1 (findings) still wrote it; exit 2 or no record is an error."""
    cmd = [sys.executable, "-m", "torchledger", "audit", example, *flags, "--fail-on", "never",
           "--format", "json", "--output", out_json]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckError(f"`{' '.join(cmd[2:])}` did not finish in {timeout:.0f} s") from None
    if r.returncode != 0 or not os.path.isfile(out_json):
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckError(f"`{' '.join(cmd[2:])}` exited {r.returncode}: {last}")
    with open(out_json, encoding="utf-8") as f:
        return json.load(f)


def allocator_peak(rec: dict):
    """The allocator's high-water mark at the traced step's last CUDA mark, or None."""
    marks = (rec.get("memory") or {}).get("cuda") or []
    peaks = [m.get("max_allocated_bytes") for m in marks if isinstance(m, dict)]
    peaks = [p for p in peaks if isinstance(p, (int, float))]
    return max(peaks) if peaks else None


def sixteen_bit_share(rec: dict):
    """The share of the record's matmul FLOPs whose operands were bf16 or fp16 (None: no matmul)."""
    from types import SimpleNamespace
    from torchledger.analyzers.precision import matmul_flops_by_dtype
    by_dtype = matmul_flops_by_dtype(SimpleNamespace(ops=rec.get("ops") or []))
    total = sum(by_dtype.values())
    return (by_dtype.get("bf16", 0) + by_dtype.get("fp16", 0)) / total if total else None


def compare(predicted: dict, measured: dict) -> list:
    """Rows ``(quantity, predicted, measured)`` from the fake record and the CUDA record."""
    p_st = (predicted.get("predictions") or {}).get("step_time") or {}
    m_st = (measured.get("predictions") or {}).get("step_time") or {}
    m_seconds = m_st.get("measured_seconds") or (measured.get("totals") or {}).get("step_seconds")
    m_mfu = None
    if m_st.get("mfu") and m_st.get("seconds") and m_st.get("measured_seconds"):
        m_mfu = m_st["mfu"] * m_st["seconds"] / m_st["measured_seconds"]    # = FLOPs / measured s / peak
    return [
        ("peak bytes (the tracer's)", predicted["totals"].get("peak_bytes"), measured["totals"].get("peak_bytes")),
        ("peak bytes (the allocator's high-water mark)", None, allocator_peak(measured)),
        ("step seconds", p_st.get("seconds"), m_seconds),
        ("MFU", p_st.get("mfu"), m_mfu),
        ("model FLOPs per step", (predicted["totals"].get("flops") or {}).get("total"),
         (measured["totals"].get("flops") or {}).get("total")),
        ("share of matmul FLOPs in 16 bits", sixteen_bit_share(predicted), sixteen_bit_share(measured)),
    ]


def _fmt(name: str, v) -> str:
    if v is None:
        return "-"
    if "bytes" in name:
        return f"{v / 2**30:,.3f} GiB"
    if "seconds" in name:
        return f"{v * 1e3:,.1f} ms"
    if name == "MFU" or "share" in name:
        return f"{v:.4f}"
    return f"{v:,}"


def table(rows: list) -> str:
    lines = [f"{'':46} {'predicted (fake)':>18} {'measured (cuda)':>18} {'pred/meas':>10}"]
    for name, p, m in rows:
        ratio = f"{p / m:.3f}" if p is not None and m else "-"
        lines.append(f"{name:46} {_fmt(name, p):>18} {_fmt(name, m):>18} {ratio:>10}")
    return "\n".join(lines)


def part_name(requested) -> str:
    """The hardware table's name for ``--gpu`` or for this machine's device."""
    import torch
    from torchledger.formulas.hardware import get_gpu
    name = requested or torch.cuda.get_device_name()
    try:
        return get_gpu(name).name
    except ValueError as e:
        raise CheckError(f"{e}: pass --gpu NAME (or add the part with TORCHLEDGER_HARDWARE)") from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_FLAGS
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("example", nargs="?", default=DEFAULT_EXAMPLE, help="a model file (default %(default)s)")
    ap.add_argument("--gpu", default=None, help="the part, as torchledger names it (default: this device's)")
    ap.add_argument("--out", default=None, help="folder for gpu-check.json and the two records")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, a {build}): nothing checked; "
              f"run it on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    try:
        gpu = part_name(args.gpu)
        out = args.out or tempfile.mkdtemp(prefix="gpu-check-")
        os.makedirs(out, exist_ok=True)
        predicted = audit(args.example, [*extra, "--gpu", gpu], os.path.join(out, "predicted.json"))
        measured = audit(args.example, [*extra, "--device", "cuda", "--gpu", gpu], os.path.join(out, "measured.json"))
    except CheckError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    rows = compare(predicted, measured)
    result = {"device": torch.cuda.get_device_name(), "gpu": gpu, "torch": torch.__version__,
              "cuda": torch.version.cuda, "example": args.example, "flags": extra,
              "rows": [{"quantity": n, "predicted": p, "measured": m} for n, p, m in rows]}
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{result['device']} as {gpu}, torch {torch.__version__}: {args.example} {' '.join(extra)}")
    print(table(rows))
    print(f"wrote {os.path.join(out, 'gpu-check.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
