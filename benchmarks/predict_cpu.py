"""CPU sanity check of the step-time model: the same per-op method, with this host's measured
matmul rate, memory bandwidth and per-op overhead as the "part", predicts the measured CPU
step time of reference models from tiny to gpt2-medium.

    PYTHONPATH=$PWD python benchmarks/predict_cpu.py [--models gpt2-tiny,llama-tiny,gpt-mini,gpt2,gpt2-medium]

Everything runs on one thread and is timed with the process's CPU clock (the host is shared:
a descheduled process's CPU clock stops, its wall clock does not). The host part (three
measurements, none of them a model's step): fp32 GEMM rate (best of 10 1024^3 ``torch.mm``),
streaming bandwidth (a 256 MB ``a + b``: 3 x 256 MB moved), per-op floor (mean of 20,000
1-element ``torch.add`` on a tensor that requires grad: what eager dispatch and autograd cost
per op). Attention on CPU (SDPA's CPU flash kernel) is assumed to
run at half the GEMM rate (not measured). Each model: batch x 128 tokens, AdamW, fp32;
measured = fastest of 5 untraced steps after 2 warm-ups; predicted = the step
traced once on the same tensors and priced with ``analyzers.steptime``.
This is a check of the per-op method (shapes, bytes, launch floor), not the GPU goal.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


#: One thread, timed in this process's CPU time: on a shared host a descheduled process's CPU
#: clock stops, so these are the times of an undisturbed single-core run.
CLOCK = time.process_time


def _best(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def host_part():
    from torchledger.formulas.hardware import GPUSpec
    threads = torch.get_num_threads()
    n = 1024
    x, y = torch.randn(n, n), torch.randn(n, n)
    torch.mm(x, y)
    rate = 2 * n ** 3 / _best(lambda: torch.mm(x, y), 10)
    a = torch.randn(64 * 2 ** 20)
    b = torch.randn(64 * 2 ** 20)
    a + b
    bw = 3 * a.nbytes / _best(lambda: a + b, 5)
    x = torch.ones(1, requires_grad=True)     # an op that records autograd, as a training step's do
    t0 = CLOCK()
    for _ in range(20000):
        torch.add(x, x)
    floor = (CLOCK() - t0) / 20000
    # a CPU GEMM blocks into small register tiles (oneDNN/MKL micro-kernels ~ 8x16..64x64) and
    # has no waves to fill beyond its cores: small tiles, short K steps
    eff = {"matmul_peak_fraction": 1.0, "memory_fraction": 1.0, "launch_s": floor,
           "matmul_tiles": [[64, 64], [32, 32], [16, 16]], "matmul_k_tile": 16, "matmul_k_overhead": 0.5,
           "matmul_min_intensity": 1.0, "attention_kernel": "flash", "attention_kernel_fp32": "flash", "attention": {"flash": [0.5, 0.5]},
           "attention_seq_half": 0.0,
           # the rates above are this host's own, measured as it runs: no sustained-training
           # derate, no collectives to slow the compute, the CPU flash kernel's causal rate
           # is the dense one's (attention_causal_fraction 1)
           "sustained_fraction": 1.0, "overlap_slowdown": 0.0, "attention_causal_fraction": 1.0}
    part = GPUSpec(f"host CPU ({threads} threads)", 0, bw, {"fp32": rate}, (), threads, None, None, 1, 1, eff,
                   {"peaks": "measured: best 1024^3 fp32 torch.mm", "bandwidth": "measured: 256 MB a + b"})
    return part, rate, bw, floor


def measure_and_predict(name, part, batch):
    import torchledger
    from torchledger.steptime.predict import predict_step_time
    from torchledger.models import build_model, get_config
    torch.manual_seed(0)
    cfg = get_config(name)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab_size, (batch, 128))

    def step():
        out = model(idx, targets=idx)
        loss = out if out.dim() == 0 else out.float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    measured = _best(step, 5)
    with torchledger.trace(model, optimizer=opt, tokens=idx.numel()) as t:
        step()
    pred = predict_step_time(t.record, part)
    return measured, pred


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-tiny,llama-tiny,gpt-mini,gpt2,gpt2-medium")
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    part, rate, bw, floor = host_part()
    import os
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; host: {torch.get_num_threads()} threads, fp32 GEMM {rate / 1e9:.1f} GFLOP/s, stream "
          f"{bw / 1e9:.1f} GB/s, per-op floor {floor * 1e6:.1f} us")
    ratios = []
    for name in args.models.split(","):
        measured, pred = measure_and_predict(name, part, args.batch)
        ratio = pred["seconds"] / measured
        ratios.append(ratio)
        print(f"{name:12s} measured {measured * 1e3:9.1f} ms  predicted {pred['seconds'] * 1e3:9.1f} ms  "
              f"predicted/measured {ratio:.2f}  ({pred['bound']})", flush=True)
    print(f"predicted/measured: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
