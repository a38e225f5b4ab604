"""Per-rank records of real pipeline-parallel steps: PyTorch's own ``PipelineStage`` with
``Schedule1F1B`` and ``ScheduleGPipe`` over gloo, on CPU.

    torchrun --standalone --nproc_per_node 2 examples/pp_ranks.py runs/
    torchledger report runs/1f1b/step1/rank0.json runs/1f1b/step1/rank1.json

A tiny MLP of two ``Linear(DIM, DIM) + ReLU`` pairs is cut in two stages, one per rank. Each
rank traces two steps of ``MICRO_BATCHES`` micro-batches of ``BATCH // MICRO_BATCHES`` rows
through a ``Ledger`` on its stage's module, and writes each record to
``OUT/<schedule>/step<i>/rank{r}.json``. The schedule's sends and receives land in the phase
of the work they carry: a stage's activations (sent by stage 0, received by stage 1) in
"forward", their gradients (sent by stage 1, received by stage 0) in "backward"; the first
step's set-up (the stages' vote and their shape metadata) stays in "other".

Not an ``audit`` file: run it under torchrun (or ``python -m torch.distributed.run``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import torchledger

BATCH, DIM, MICRO_BATCHES, STEPS = 8, 8, 2, 2


def stage_module(rank: int) -> nn.Module:
    torch.manual_seed(0)                          # the same full model on every rank
    full = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU())
    return nn.Sequential(*list(full)[2 * rank: 2 * rank + 2])


def run(out: str, rank: int, schedule: str) -> list:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    world = dist.get_world_size()
    module = stage_module(rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, MICRO_BATCHES, loss_fn=lambda out, target: (out - target).square().mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ledger = torchledger.Ledger(module, optimizer=opt)
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        with ledger.step(tokens=BATCH):
            if rank == 0:
                sched.step(x)                     # first stage: the inputs
            else:
                sched.step(target=torch.zeros(BATCH, DIM), losses=[])   # last stage: the loss
            opt.step()
            opt.zero_grad()
    paths = []
    for i, rec in enumerate(ledger.records):
        os.makedirs(os.path.join(out, schedule, f"step{i}"), exist_ok=True)
        paths.append(rec.save(os.path.join(out, schedule, f"step{i}", "rank{rank}.json")))
    return paths


def main(out: str, schedules=("1f1b", "gpipe")) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for schedule in schedules:
            for path in run(out, rank, schedule):
                print(f"rank {rank}: wrote {path}", file=sys.stderr)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: torchrun --standalone --nproc_per_node 2 examples/pp_ranks.py OUT_DIR [1f1b|gpipe ...]")
    main(sys.argv[1], tuple(sys.argv[2:]) or ("1f1b", "gpipe"))
