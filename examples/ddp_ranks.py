"""Per-rank records of real distributed steps: DDP and FSDP2 over gloo, on CPU.

    torchrun --standalone --nproc_per_node 2 examples/ddp_ranks.py runs/
    torchledger report runs/ddp/rank0.json runs/ddp/rank1.json
    torchledger report runs/fsdp/rank*.json --format json

Each rank builds the same tiny MLP, wraps it in DDP (then, a second copy, in FSDP2's
``fully_shard``), traces one training step on its own batch of ``BATCH`` rows and writes its
record: the DDP one through a ``Ledger`` (``ledger.save("runs/ddp/")`` -> ``rank{r}.json``),
the FSDP2 one through ``trace`` (``t.record.save("runs/fsdp/rank{rank}.json")``). Each
record knows its rank, the world size and the mesh (``totals.rank``, ``world_size``, ``mesh``).

Not an ``audit`` file: run it under torchrun (or ``python -m torch.distributed.run``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import torchledger

BATCH, DIM, HIDDEN, OUT = 4, 8, 16, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)                          # the same weights on every rank
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def batch(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + rank))


def ddp_step(out: str, rank: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ledger = torchledger.Ledger(model, optimizer=opt)
    x = batch(rank)
    with ledger.step(tokens=BATCH):
        model(x).square().mean().backward()       # DDP all-reduces the gradients here
        opt.step()
        opt.zero_grad()
    return ledger.save(os.path.join(out, "ddp") + os.sep)


def fsdp_step(out: str, rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = batch(rank)
    with torchledger.trace(model, opt, tokens=BATCH) as t:   # the mesh: from the DTensor parameters
        model(x).square().mean().backward()       # FSDP2: all-gather, then reduce-scatter
        opt.step()
        opt.zero_grad()
    return t.record.save(os.path.join(out, "fsdp", "rank{rank}.json"))


def main(out: str, parts=("ddp", "fsdp")) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for part in parts:
            os.makedirs(os.path.join(out, part), exist_ok=True)
            path = (ddp_step if part == "ddp" else fsdp_step)(out, rank)
            print(f"rank {rank}: wrote {path}", file=sys.stderr)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: torchrun --standalone --nproc_per_node 2 examples/ddp_ranks.py OUT_DIR [ddp|fsdp ...]")
    main(sys.argv[1], tuple(sys.argv[2:]) or ("ddp", "fsdp"))
