"""A training step with the classic mistakes torchledger finds.

- the loss is kept with its graph across steps (`losses.append(loss)`, no `.item()`);
- the forward permutes, copies and permutes back (a needless copy);
- a dtype round trip (float32 -> bfloat16 -> float32).
Run `torchledger audit examples/leaky_step.py --device cpu` and `torchledger lint examples/`.
"""
import torch
import torch.nn as nn

import torchledger

losses = []


class Leaky(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):                       # x: (B, T, d)
        y = x.transpose(1, 2).contiguous()      # needless copy: permuted back on the next line
        y = y.transpose(1, 2)
        y = self.proj(y).to(torch.bfloat16).to(torch.float32)   # dtype round trip
        return self.out(y).mean()


def step(model, inputs, optimizer):
    loss = model(inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss)                         # keeps every step's loss tensor alive


def audit_spec():
    return torchledger.AuditSpec(Leaky(), torch.randn(8, 16, 64), step=step)
