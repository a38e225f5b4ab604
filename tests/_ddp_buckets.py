"""Real DDP's gradient buckets over gloo, for tests/test_dist_layouts.py: models whose modules
are registered out of the order forward uses them, wrapped in PyTorch's own
``DistributedDataParallel`` on two CPU ranks, three SGD steps each. A comm hook records every
bucket the C++ reducer hands it (its index, its parameters' names, its buffer's bytes) and then
does the default's work (``allreduce_hook``); DDP's own logging data adds the reducer's bucket
sizes after the rebuild.

    torchrun --nproc_per_node 2 tests/_ddp_buckets.py OUT

Each rank writes OUT/<case>/rank{r}.json: {"buckets": [[index, [names], bytes], ...] in the
order the hook saw them, "logging": {"bucket_sizes": ..., "rebuilt_bucket_sizes": ...}}. The
models, their DDP arguments (``CASES``) and the hook are the ones the simulated audit is
compared with (tests/test_dist_layouts.py runs them under the fake process group, the hook
noting into ``SIM_LOG``)."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn


class HeadFirst(nn.Module):
    """Five Linear(256, 256) layers (263,168 B of fp32 each) used in the order inp, blocks, head
    but registered head, blocks, inp: the head registered first, used last."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.head = nn.Linear(d, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.inp = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


class Small(nn.Module):
    """head Linear(32, 64) registered before a (16 -> 32 -> 32) stack forward runs first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 64)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x):
        return self.head(self.blocks(x))


#: case -> (model class, its input's shape, DDP keyword arguments, micro-batches a step)
CASES = {
    "head_first": (HeadFirst, (4, 256), {}, 1),                       # DDP's default caps
    "small": (Small, (4, 16), {"bucket_cap_mb": 0.008}, 1),
    # the first micro-batch of each step under no_sync: no all-reduce, and no ready order
    "small_no_sync": (Small, (4, 16), {"bucket_cap_mb": 0.008}, 2),
}
STEPS = 3
SIM_LOG: list = []      # the simulated audit's buckets (tests/test_dist_layouts.py)


def recording_hook(names: dict, log: list):
    """A comm hook noting each bucket (index, parameter names, buffer bytes) in ``log``, then
    all-reducing it as DDP's default does (torch's own ``allreduce_hook``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        buf = bucket.buffer()
        log.append([bucket.index(), [names[id(p)] for p in bucket.parameters()],
                    buf.numel() * buf.element_size()])
        return allreduce_hook(state, bucket)
    return hook


def per_step(log: list) -> list:
    """The buckets of ``log`` split by step: the reducer hands them over in index order, so
    each step starts at bucket 0."""
    steps: list = []
    for entry in log:
        if entry[0] == 0:
            steps.append([])
        steps[-1].append(entry)
    return steps


def train_step(ddp, x, opt, micro: int) -> None:
    """``micro`` forward/backward passes, all but the last under ``no_sync``, then SGD."""
    import contextlib
    for i in range(micro):
        with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
            ddp(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def run_case(name: str, out: str, rank: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    cls, shape, kwargs, micro = CASES[name]
    torch.manual_seed(0)
    model = cls()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DDP(model, **kwargs)
    log: list = []
    ddp.register_comm_hook(dist.group.WORLD, recording_hook(names, log))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(*shape)
    for _ in range(STEPS):
        train_step(ddp, x, opt, micro)
    data = ddp._get_ddp_logging_data()
    keep = {k: data.get(k) for k in ("bucket_sizes", "rebuilt_bucket_sizes",
                                     "rebuilt_per_bucket_param_indices")}
    os.makedirs(os.path.join(out, name), exist_ok=True)
    with open(os.path.join(out, name, f"rank{rank}.json"), "w") as f:
        json.dump({"buckets": log, "logging": keep}, f)


def main(out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for name in CASES:
            run_case(name, out, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
