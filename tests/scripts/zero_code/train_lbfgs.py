"""LBFGS with a closure (several backward calls per step); tdbg-free unless ZC_WATCH=1."""

from __future__ import annotations

import torch
from torch import nn
from zc_common import hold, watch_if_asked


def main() -> None:
    torch.manual_seed(2)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    probe = watch_if_asked(model, optimizer)
    x = torch.randn(40, 4)
    y = (x**2).sum(dim=1, keepdim=True)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(12):
        loss = optimizer.step(closure)  # the first evaluation of this step's closure
        if probe is not None:
            probe.step(loss)
    print(f"final loss {loss.item():.6f}")
    hold()


if __name__ == "__main__":
    main()
