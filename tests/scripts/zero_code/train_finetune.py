"""Fine-tuning as scripts do it: train, then a new head and a new optimizer (the backbone frozen
when FREEZE=1). Prints, as JSON, each step's learning rate and the step the head changed."""

import json
import os

import torch
from torch import nn

torch.manual_seed(0)
FREEZE = os.environ.get("FREEZE", "0") == "1"
FIRST, SECOND = 25, 15  # the head changes after 25 steps: past tdbg run's discovery


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


model = Net()
opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
lrs = []
for step in range(FIRST + SECOND):
    if step == FIRST:
        model.head = nn.Linear(16, 4)
        if FREEZE:
            model.backbone.requires_grad_(False)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    lrs.append(opt.param_groups[0]["lr"])
print(json.dumps({"lr": lrs, "changed": FIRST}))
