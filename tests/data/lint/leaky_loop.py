"""A leaky training loop, whose memory grows slowly step after step:
every loss is kept with its autograd graph, and gradients are never cleared."""
import torch
from torch import nn

model = nn.Linear(512, 512)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [(torch.randn(32, 512), torch.randn(32, 512)) for _ in range(10)]
losses = []
for x, y in loader:  # TL-LINT-002: no zero_grad anywhere in the loop
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    optimizer.step()
    losses.append(loss)  # TL-LINT-001: keeps every step's graph alive
print(sum(losses) / len(losses))
