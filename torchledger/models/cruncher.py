"""The course's deep linear model "Cruncher" (docs/counting.md).

``num_layers`` x Linear(dim, dim) then Linear(dim, 1); weights ``randn(in, out) / sqrt(in)``,
no bias; forward is ``x @ w`` per layer and the output is squeezed.
Params = dim*dim*num_layers + dim. Activations (float32, batch B) ~ B*dim*num_layers values.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import CruncherConfig

__all__ = ["Cruncher"]


class Linear(nn.Module):
    def __init__(self, input_dim: int, output_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(input_dim, output_dim) / math.sqrt(input_dim))

    def forward(self, x):
        return x @ self.weight                                   # (B, in) @ (in, out)


class Cruncher(nn.Module):
    def __init__(self, cfg: CruncherConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(Linear(cfg.dim, cfg.dim) for _ in range(cfg.num_layers))
        self.final = Linear(cfg.dim, 1)

    def forward(self, x):                                        # x: (B, dim)
        for layer in self.layers:
            x = layer(x)
        return self.final(x).squeeze(-1)                         # (B,)
