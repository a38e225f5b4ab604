"""A mixture-of-experts MLP for the reference decoder (``MoEConfig``: top-k routing over E
SwiGLU experts with a fixed capacity, GShard/Switch style), and its expert parallelism.

Shapes are static (fake tensors cannot size a buffer by routed counts): each expert takes
C = ceil(capacity_factor x N x k / E) of the N tokens' k choices; choices beyond an expert's
capacity are dropped (their output is zero), as in Switch Transformer. With expert
parallelism over a group of ``ep`` ranks each rank holds E / ep experts; the dispatch buffer
(E, C, d) goes to the experts' ranks by one all-to-all and comes back by another (their
backward: two more), each of E x C x d elements on every rank.

    >>> cfg = MoEConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=32,
    ...                 mlp="swiglu", n_experts=4, top_k=2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TransformerConfig

__all__ = ["MoEConfig", "MoE", "GroupedExperts"]


@dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    """A decoder whose MLPs are mixtures of ``n_experts`` SwiGLU experts of width ``d_ff``."""

    n_experts: int = 8
    """E: experts per MoE layer."""
    top_k: int = 2
    """k: experts each token is routed to."""
    capacity_factor: float = 1.25
    """Expert capacity C = ceil(capacity_factor x tokens x k / E)."""

    def __post_init__(self):
        super().__post_init__()
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")

    @property
    def kind(self) -> str:
        return "moe-transformer"


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three (E, in, out) weights: one batched matmul each."""

    def __init__(self, n_experts: int, d: int, f: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d, f))
        self.w_up = nn.Parameter(torch.empty(n_experts, d, f))
        self.w_down = nn.Parameter(torch.empty(n_experts, f, d))
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=0.02)

    def forward(self, x):                                      # (E_local, M, d)
        # the weights in the rows' dtype: under expert parallelism without dp they stay outside
        # FSDP2 (fp32) while its mixed-precision policy hands the block 16-bit activations
        w_gate, w_up, w_down = (w.to(x.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        return torch.bmm(F.silu(torch.bmm(x, w_gate)) * torch.bmm(x, w_up), w_down)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = cfg.n_experts, cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.d_ff)
        self.ep_mesh = None
        """Set by expert parallelism: the 1-D mesh whose ranks share the experts."""

    def capacity(self, tokens: int) -> int:
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def forward(self, x):
        B, T, d = x.shape
        E, k = self.n_experts, self.top_k
        xs = x.reshape(B * T, d)
        N = xs.shape[0]
        C = self.capacity(N)
        w, idx = self.router(xs).softmax(-1).topk(k, dim=-1)                 # (N, k)
        choice = idx.reshape(-1)                                             # (N k,)
        onehot = F.one_hot(choice, E)                                        # (N k, E)
        pos = ((onehot.cumsum(0) - 1) * onehot).sum(-1)                      # place in its expert
        keep = (pos < C).to(x.dtype)
        slot = choice * C + pos.clamp(max=C - 1)                             # (N k,)
        src = xs.repeat_interleave(k, 0) * keep[:, None]
        buf = xs.new_zeros(E * C, d).index_add(0, slot, src).view(E, C, d)  # dispatch buffer
        y = self._experts(buf)                                               # (E, C, d)
        out = y.reshape(E * C, d).index_select(0, slot) * (keep * w.reshape(-1))[:, None]
        return out.view(N, k, d).sum(1).view(B, T, d)

    def _experts(self, buf):
        if self.ep_mesh is None:
            return self.experts(buf)
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        E, C, d = buf.shape
        ep = self.ep_mesh.size()
        # dispatch: chunk j of dim 0 (experts j E/ep ..) goes to rank j; from each rank this
        # rank receives the tokens it routed to its E/ep experts
        got = all_to_all_single_autograd(buf.contiguous(), None, None, self.ep_mesh)     # (ep E_l, C, d)
        local = E // ep
        h = got.view(ep, local, C, d).transpose(0, 1).reshape(local, ep * C, d)
        h = self.experts(h)
        back = h.view(local, ep, C, d).transpose(0, 1).reshape(E, C, d)
        return all_to_all_single_autograd(back.contiguous(), None, None, self.ep_mesh)   # combine
