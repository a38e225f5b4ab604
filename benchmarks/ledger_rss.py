"""What a Ledger costs over a long run: RSS growth and the amortised time per step.

    python benchmarks/ledger_rss.py [--steps 300] [--warmup 50] [--repeats 5] [--model mlp]

1. RSS: ``--steps`` training steps of a small model, each with an evaluation forward that
   is never backpropagated (no ``no_grad``: the case where the tracer used to keep every
   saved tensor alive), run untraced, under ``Ledger(sample_every=1)`` and under
   ``Ledger(sample_every=50)``, each in a fresh subprocess. Prints the RSS growth from the
   end of the warm-up steps to the end, and the trend (least-squares slope of a reading every
   10 steps, times the steps: a leak is a trend, allocator noise a jump). Target: the traced
   runs grow no more than the untraced one, within a few MB of allocator noise.
2. Time: ``--repeats`` x 100 steps without a Ledger and as many under
   ``Ledger(sample_every=100)``, alternating step by step in one process (so the drifting
   load of a shared machine hits both alike). Process CPU time is the figure; wall time is
   printed beside it. Amortised overhead = CPU of the ledger's steps / CPU of the untraced
   ones - 1. Target: under 2%.

Torch runs on one thread so that CPU time measures this process's work alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchledger

MODES = {"untraced": None, "Ledger(sample_every=1)": 1, "Ledger(sample_every=50)": 50}


def rss_mib() -> float:
    """Resident set size now (Linux /proc), else the peak (resource), in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def build(name: str):
    """Model, optimizer and a batch maker: ``mlp`` (256-1024-256 blocks, ReLU then GELU, batch 64)
    or ``gpt2-tiny`` (torchledger.models, batch 4 x 64)."""
    torch.manual_seed(0)
    if name == "mlp":
        # ReLU saves its own output for backward: the op whose saved tensor the tracer's
        # hook used to hold in a cycle (GELU saves its input, which never leaked)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.LayerNorm(256),
                              nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

        def loss_of(seed):
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
            return F.mse_loss(model(x), y)
    else:
        from torchledger.models import build_model, example_inputs
        model = build_model(name)

        def loss_of(seed):
            torch.manual_seed(seed)
            return model(**example_inputs(name, batch=4, seq_len=64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_of


def train_step(model, opt, loss_of, i: int, evals: list) -> None:
    loss = loss_of(i)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    evals.append(loss_of(10**6 + i).item())     # an eval forward, never backpropagated


def run(ledger, model, opt, loss_of, start: int, steps: int, evals: list) -> None:
    for i in range(start, start + steps):
        if ledger is None:
            train_step(model, opt, loss_of, i, evals)
        else:
            with ledger.step(tokens=64):
                train_step(model, opt, loss_of, i, evals)


def child(mode: str, model_name: str, steps: int, warmup: int) -> dict:
    """One fresh process: warm up, then run to ``steps``; RSS at both points."""
    torch.set_num_threads(1)
    model, opt, loss_of = build(model_name)
    every = MODES[mode]
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=every) if every else None
    evals: list = []
    run(ledger, model, opt, loss_of, 0, warmup, evals)
    gc.collect()
    at, rss = [warmup], [rss_mib()]
    seconds = 0.0
    for start in range(warmup, steps, 10):         # an RSS reading every 10 steps
        n = min(10, steps - start)
        t0 = time.perf_counter()
        run(ledger, model, opt, loss_of, start, n, evals)
        seconds += time.perf_counter() - t0
        gc.collect()
        at.append(start + n)
        rss.append(rss_mib())
    rules = sorted({f.rule for f in ledger.findings()}) if ledger else []
    return {"mode": mode, "rss_warm_mib": rss[0], "rss_end_mib": rss[-1], "growth_mib": rss[-1] - rss[0],
            "trend_mib": _slope(at, rss) * (steps - warmup), "rss_max_mib": max(rss),
            "seconds": seconds, "records": len(ledger.records) if ledger else 0, "findings": rules,
            "last_eval": evals[-1]}


def _slope(x: list, y: list) -> float:
    """Least-squares slope of y over x (a leak is a trend; allocator noise is a jump)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    var = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / var if var else 0.0


def overhead(model_name: str, repeats: int, block: int) -> dict:
    """``repeats x block`` steps untraced and as many under Ledger(sample_every=block), one
    of each in turn (so the machine's drifting load hits both alike), process CPU time per
    step: the amortised overhead is the ratio of the two sums, less one."""
    torch.set_num_threads(1)
    model, opt, loss_of = build(model_name)
    ledger = torchledger.Ledger(model, optimizer=opt, sample_every=block)
    evals: list = []
    run(None, model, opt, loss_of, 0, 10, evals)                     # warm-up
    cpu = {"untraced": [], "ledger": [], "traced": []}
    wall = {"untraced": 0.0, "ledger": 0.0}
    for i in range(10, 10 + 2 * repeats * block):
        name = "ledger" if i % 2 else "untraced"
        traced = name == "ledger" and ledger.steps % block == 0
        c0, w0 = time.process_time(), time.perf_counter()
        run(ledger if name == "ledger" else None, model, opt, loss_of, i, 1, evals)
        cpu[name].append(time.process_time() - c0)
        wall[name] += time.perf_counter() - w0
        if traced:
            cpu["traced"].append(cpu[name][-1])
    total = {k: sum(cpu[k]) for k in ("untraced", "ledger")}
    return {"block": block, "repeats": repeats, "traced_steps": len(ledger.records),
            "cpu_s": total, "wall_s": wall,
            "overhead_cpu": total["ledger"] / total["untraced"] - 1,
            "overhead_wall": wall["ledger"] / wall["untraced"] - 1,
            "step_cpu_ms": {"untraced": statistics.median(cpu["untraced"]) * 1e3,
                            "traced": statistics.fmean(cpu["traced"]) * 1e3}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per RSS run (default 300)")
    ap.add_argument("--warmup", type=int, default=50, help="steps before the first RSS reading")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks of --block steps per variant")
    ap.add_argument("--block", type=int, default=100, help="steps per timed block = sample_every")
    ap.add_argument("--model", choices=("mlp", "gpt2-tiny"), default="mlp")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 0 < args.warmup < args.steps:
        ap.error(f"--warmup must be between 1 and --steps - 1 ({args.steps - 1}), got {args.warmup}")
    if args.child:
        print(json.dumps(child(args.child, args.model, args.steps, args.warmup)))
        return
    out: dict = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "rss": []}
    if not args.skip_rss:
        print(f"RSS growth from step {args.warmup} to step {args.steps} ({args.model}, "
              f"each run in a fresh process):")
        for mode in MODES:
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model,
                                "--steps", str(args.steps), "--warmup", str(args.warmup)],
                               capture_output=True, text=True, check=False)
            if p.returncode:
                sys.exit(f"{mode} run failed:\n{p.stderr[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            out["rss"].append(r)
            print(f"  {mode:<24} {r['growth_mib']:+6.1f} MiB, trend {r['trend_mib']:+6.1f} MiB  "
                  f"({r['rss_warm_mib']:.1f} -> {r['rss_end_mib']:.1f} MiB, max {r['rss_max_mib']:.1f}; "
                  f"{r['seconds']:.1f} s, {r['records']} records kept, "
                  f"findings: {', '.join(r['findings']) or 'none'})")
    if not args.skip_time:
        o = overhead(args.model, args.repeats, args.block)
        out["time"] = o
        print(f"Time: {o['repeats'] * o['block']} steps untraced and as many under "
              f"Ledger(sample_every={o['block']}), alternating step by step:")
        print(f"  untraced  CPU {o['cpu_s']['untraced']:.2f} s   wall {o['wall_s']['untraced']:.2f} s")
        print(f"  ledger    CPU {o['cpu_s']['ledger']:.2f} s   wall {o['wall_s']['ledger']:.2f} s   "
              f"({o['traced_steps']} traced steps, {o['step_cpu_ms']['traced']:.1f} ms CPU each against "
              f"a median untraced step of {o['step_cpu_ms']['untraced']:.1f} ms)")
        print(f"  amortised overhead per step: {o['overhead_cpu']:+.1%} CPU, "
              f"{o['overhead_wall']:+.1%} wall (target: under 2%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
