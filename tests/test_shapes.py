"""A nanoGPT-style user model (its own config dataclass) is recognised and predicted exactly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchledger


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 300
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    bias: bool = True


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.mlp_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_nanogpt_style_model_is_recognised():
    c = GPTConfig()
    model = GPT(c)
    B, T = 2, 16
    idx = torch.randint(0, c.vocab_size, (B, T))
    with torchledger.trace(model, tokens=B * T, seq_len=T) as t:
        model(idx, idx).backward()
    rec = t.record
    assert rec.meta["config"]["source"] == "config:GPTConfig"
    assert rec.meta["config"]["n_positions"] == 64
    assert rec.predictions["params_exact"] == rec.totals["params"] == sum(p.numel() for p in model.parameters())
    N = c.n_layer * 12 * c.n_embd ** 2 + c.vocab_size * c.n_embd
    assert rec.totals["matmul_params"] == N
    assert rec.totals["flops"]["total"] == rec.predictions["flops_6nd_attention"] \
        == 6 * N * B * T + 12 * c.n_layer * T * c.n_embd * B * T


def test_model_without_config_is_recognised_from_its_modules():
    c = GPTConfig()
    model = GPT(c)
    del model.config                                    # a user model with no config object
    B, T = 2, 16
    idx = torch.randint(0, c.vocab_size, (B, T))
    with torchledger.trace(model, tokens=B * T, seq_len=T) as t:
        model(idx, idx).backward()
    rec = t.record
    cfg = rec.meta["config"]
    assert cfg["partial"] and (cfg["n_layers"], cfg["d_model"], cfg["vocab_size"]) == (2, 32, 300)
    assert cfg["n_heads"] == 4                          # found on the block (self.n_head)
    assert rec.predictions["params_12ld2"] == 12 * 2 * 32 ** 2 + 300 * 32
    assert "params_exact" not in rec.predictions        # no exact formula without a config
    N = rec.totals["matmul_params"]
    assert rec.predictions["flops_6nd_attention"] == rec.totals["flops"]["total"] \
        == 6 * N * B * T + 12 * 2 * T * 32 * B * T
    rows = {r["quantity"] for r in rec.predictions["comparisons"]}
    assert "parameters (12*L*d^2 + V*d)" in rows and "parameters (exact formula)" not in rows


def test_plain_mlp_is_not_taken_for_a_transformer():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torchledger.trace(mlp, tokens=3) as t:
        mlp(torch.randn(3, 4)).sum().backward()
    assert t.record.meta["config"] is None
    assert t.record.predictions["params_12ld2"] is None
