"""A small GPT and its training loop in nanoGPT's style, with torchledger around both.

The model returns ``(logits, loss)`` (``loss`` None without targets), it prints its parameter
count when built, and the loop has what real loops have: AdamW with weight decay groups,
gradient accumulation, gradient clipping, an eval forward every ``eval_every`` steps and
``torch.compile`` where it works on this machine.

    torchledger audit examples/nanogpt_loop.py --format json      # the audit reads audit_spec()
    python examples/nanogpt_loop.py --steps 100                   # trains under torchledger.Ledger

The audit backpropagates the model's own loss (``loss: output[1]``); the loop's traced steps
run eagerly while its untraced steps run compiled (torch.compile's cache is left alone).
"""
from __future__ import annotations

import argparse
import math
import shutil
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchledger


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):                                      # x: [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                  # weight tying
        self.apply(self._init)
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):                     # idx: [B, T] token ids
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                     # [B, T, V]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizer(self, lr=3e-3, weight_decay=0.1):
        """AdamW; matrices decay, norms and biases do not (nanoGPT's two groups)."""
        params = {id(p): p for p in self.parameters() if p.requires_grad}.values()
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def audit_spec():
    """What ``torchledger audit`` runs: one batch of 8 x 32 tokens and the model's own loss."""
    cfg = GPTConfig()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (8, cfg.block_size))
    targets = torch.roll(idx, -1, dims=1)
    return torchledger.AuditSpec(model, (idx, targets),
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))


# -- the training loop -----------------------------------------------------------------------------
def get_batch(data, batch_size, block_size, gen):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def compile_backend() -> str | None:
    """inductor where it can build (a C compiler is on PATH), else None (eager)."""
    return "inductor" if shutil.which("cc") or shutil.which("gcc") else None


def train(steps=100, *, ledger_every=None, backend="auto", batch_size=4, accum=2, eval_every=10,
          seed=0, on_step=None):
    """Train ``steps`` optimizer steps; returns ``(losses, ledger, model)``.

    ``ledger_every``: wrap each step in a ``torchledger.Ledger`` tracing one in that many (None:
    no Ledger). ``backend``: a torch.compile backend, "auto" (inductor where it builds) or None.
    ``on_step(i)`` is called after each step (tests read dynamo's counters there).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = GPTConfig()
    data = torch.randint(0, cfg.vocab_size, (4096,), generator=gen)
    data[1::2] = (data[0::2] * 7 + 3) % cfg.vocab_size          # something to learn
    model = GPT(cfg)
    opt = model.configure_optimizer()
    backend = compile_backend() if backend == "auto" else backend
    run = torch.compile(model, backend=backend) if backend else model
    ledger = torchledger.Ledger(run, optimizer=opt, sample_every=ledger_every) if ledger_every else None
    losses = []
    for i in range(steps):
        lr = 3e-3 * min(1.0, (i + 1) / 10) * (0.5 * (1 + math.cos(math.pi * i / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        if eval_every and i % eval_every == 0:                  # the eval forward, no grad
            model.eval()
            with torch.no_grad():
                x, y = get_batch(data, batch_size, cfg.block_size, gen)
                _, val = run(x, y)
            model.train()
        with ledger.step(tokens=batch_size * cfg.block_size * accum) if ledger else _nothing():
            total = 0.0
            for _ in range(accum):                               # gradient accumulation
                x, y = get_batch(data, batch_size, cfg.block_size, gen)
                _, loss = run(x, y)
                (loss / accum).backward()
                total += loss.item() / accum
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
        if on_step is not None:
            on_step(i)
    return losses, ledger, model


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sample-every", type=int, default=25, help="Ledger traces one step in this many")
    ap.add_argument("--backend", default="auto", help="torch.compile backend, 'auto' or 'none'")
    ap.add_argument("--compare", action="store_true",
                    help="also train without the Ledger and print how the two runs differ")
    args = ap.parse_args()
    backend = None if args.backend == "none" else args.backend
    losses, ledger, model = train(args.steps, ledger_every=args.sample_every, backend=backend)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
    print(ledger.report())
    if args.compare:
        torch._dynamo.reset()
        plain, _, untraced = train(args.steps, backend=backend)
        ours, theirs = model.state_dict(), untraced.state_dict()
        print(f"against an untraced run ({backend or 'no'} compile): "
              f"{sum(a != b for a, b in zip(losses, plain))} of {args.steps} losses differ; "
              f"weights differ by at most {max((ours[k] - theirs[k]).abs().max().item() for k in ours):.3g}")
