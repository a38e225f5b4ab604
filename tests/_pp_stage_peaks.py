"""A real 2-rank pipeline of the pipeline tests' llama-tiny (4 blocks, 4 KV heads, fp32), for
tests/test_pipeline_buffers.py: PyTorch's own ``PipelineStage`` and schedule over gloo, each
rank's step traced by ``torchledger.Ledger`` on its stage's module, the stages' set-up
(their receive buffers) inside the traced step.

    torchrun --nproc_per_node 2 tests/_pp_stage_peaks.py OUT [SCHEDULE] [M]

Rank 0 holds the embedding and blocks 0-1, rank 1 blocks 2-3, the final norm and the head; the
loss is the audit's (cross-entropy of the fp32 logits). SGD (no state) steps the parameters.
Each rank writes OUT/<schedule>/rank{r}.json (the first step's record)."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchledger
from torchledger.models import build_model, get_config
from torchledger.models.transformer import rope_tables

MICRO_BATCH, T = 2, 32


class Stage(nn.Module):
    """Blocks ``lo..hi-1`` of the model, with the embedding (first) or the norm and head (last)."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.cfg = model.config
        self.tok_emb = model.tok_emb if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        rope = rope_tables(x.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def stage_mem_tracker():
    """PyTorch's ``MemTracker``, but a module that runs again in forward (the stage's module,
    once per micro-batch) keeps the statistics of its first run: MemTracker refuses a root
    module's second forward as a second iteration. The live bytes it counts are its own."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StageMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

    return StageMemTracker()


def run(out: str, schedule: str, m: int) -> str:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = get_config("llama-tiny").replace(n_kv_heads=4, n_layers=4, norm="layernorm")
    model = build_model(cfg)
    stage_mod = Stage(model, 2 * rank, 2 * rank + 2, rank == 0, rank == 1)
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, m, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    idx = torch.randint(0, cfg.vocab_size, (m * MICRO_BATCH, T), generator=torch.Generator().manual_seed(1))

    def step():
        if rank == 0:
            sched.step(idx)
        else:
            sched.step(target=idx, losses=[])
        opt.step()
        opt.zero_grad()

    step()          # the stages' set-up (MemTracker's hooks refuse its autograd.grad)
    buffers = [info.buffer for infos in (stage.args_recv_info, stage.grad_recv_info)
               for mb in infos.values() for info in mb if info.buffer is not None]
    mt = stage_mem_tracker()
    mt.track_external(stage_mod, opt, *buffers)
    with mt:
        step()
    peak = mt.get_tracker_snapshot("peak")
    cpu = {str(k): v for dev, d in peak.items() if dev.type == "cpu" for k, v in d.items()}
    os.makedirs(os.path.join(out, f"{schedule}{m}"), exist_ok=True)
    path = os.path.join(out, f"{schedule}{m}", f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(cpu, f)
    return path


def main(out: str, runs) -> None:
    dist.init_process_group("gloo")
    try:
        for schedule, m in runs:
            print(f"rank {dist.get_rank()}: wrote {run(out, schedule, m)}", file=sys.stderr)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [("1f1b", 4), ("gpipe", 4)])
