"""Idiomatic training code: torchledger lint must report nothing here."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.1):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x, mask=None, return_attn: bool = False):
        batch, seq, dim = x.shape
        if x.shape[0] > 1 and x.size(-1) == dim:    # shapes are host values already
            x = x.contiguous()
        if self.training:
            x = F.dropout(x, self.dropout)
        if mask is not None:
            x = x.masked_fill(mask, 0.0)
        assert x.dim() == 3, "expected (batch, seq, dim)"
        h = self.proj(x)
        return (h, None) if return_attn else h


def train(model, loader, optimizer, accum_steps=4, device="cuda"):
    model.to(device)
    losses, running = [], 0.0
    total = torch.zeros((), device=device)
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:            # gradient accumulation
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        running += loss.item()
        total += loss.detach()
    return losses, running, total


def train_zero_grad_first(model, loader, optimizer):
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def predict(model, loader):
    outputs = []
    for x, _ in loader:
        outputs.append(model(x))
    return torch.cat(outputs)


def evaluate(model, loader):
    outputs = []
    with torch.inference_mode():
        for x, _ in loader:
            outputs.append(model(x))
    return outputs


def save(model, optimizer, step, path):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, path)


def load(path):
    return torch.load(path, weights_only=True)


loader = DataLoader(list(range(8)), batch_size=4, pin_memory=True)
