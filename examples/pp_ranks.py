"""Per-rank records of real pipeline-parallel steps: PyTorch's own ``PipelineStage`` with
``Schedule1F1B`` and ``ScheduleGPipe`` over gloo, on CPU.

    torchrun --standalone --nproc_per_node 2 examples/pp_ranks.py runs/
    torchledger report runs/1f1b/step1/rank0.json runs/1f1b/step1/rank1.json

A tiny MLP of two ``Linear(DIM, DIM) + ReLU`` pairs is cut in two stages, one per rank
(``interleaved``: four pairs cut in four stages, rank r holding stages r and r + 2 in an
``nn.ModuleList``, run by ``ScheduleInterleaved1F1B``). Each rank traces two steps of ``MICRO_BATCHES`` micro-batches of ``BATCH // MICRO_BATCHES`` rows
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


def stage_modules(rank: int, world: int, chunks: int) -> list:
    """This rank's stages of a model of ``chunks * world`` Linear + ReLU pairs: r, r + world..."""
    torch.manual_seed(0)                          # the same full model on every rank
    pairs = [nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(chunks * world)]
    return [(i, pairs[i]) for i in range(rank, chunks * world, world)]


def run(out: str, rank: int, schedule: str) -> list:
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    world = dist.get_world_size()
    chunks = 2 if schedule == "interleaved" else 1
    mine = stage_modules(rank, world, chunks)
    stages = [PipelineStage(m, i, chunks * world, torch.device("cpu")) for i, m in mine]
    loss = lambda out, target: (out - target).square().mean()   # noqa: E731
    if schedule == "interleaved":
        module = nn.ModuleList([m for _, m in mine])
        sched = ScheduleInterleaved1F1B(stages, MICRO_BATCHES, loss_fn=loss)
    else:
        module = mine[0][1]
        sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stages[0], MICRO_BATCHES, loss_fn=loss)
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


def main(out: str, schedules=("1f1b", "gpipe", "interleaved")) -> None:
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
        sys.exit("usage: torchrun --standalone --nproc_per_node 2 examples/pp_ranks.py OUT_DIR "
                 "[1f1b|gpipe|interleaved ...]")
    main(sys.argv[1], tuple(sys.argv[2:]) or ("1f1b", "gpipe", "interleaved"))
