"""Two phases, two optimizers: SGD for 40 steps, then a new Adam for the same model."""

from __future__ import annotations

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(60):
    if step == 40:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # phase two
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
print("done")
