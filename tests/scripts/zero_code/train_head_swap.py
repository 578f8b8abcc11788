"""Fine-tuning: at step 40 a new head, the backbone frozen, an optimizer of the head only."""

from __future__ import annotations

import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


model = Net()
opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(70):
    if step == 40:
        model.head = nn.Linear(16, 1)
        model.body.requires_grad_(False)
        opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
print("done")
