"""A plain training script with Adam: nothing in it knows about tdbg unless ZC_WATCH=1."""

from __future__ import annotations

import torch
from torch import nn
from zc_common import hold, watch_if_asked


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.MSELoss()
    probe = watch_if_asked(model, optimizer)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(30):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if probe is not None:
            probe.step(loss)
    print(f"final loss {loss.item():.6f}")
    hold()


if __name__ == "__main__":
    main()
