"""SAM-style: a wrapper optimizer that steps a base optimizer over the same parameters
(``closure``: SAM.step(closure), the base's step inside it; ``manual``: first_step/second_step,
only the base's step hooked by torch)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


class SAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                e = p.grad * 0.05 / (p.grad.norm() + 1e-12)
                p.add_(e)
                self.state[p]["e"] = e

    @torch.no_grad()
    def second_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        self.base_optimizer.step()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        closure = torch.enable_grad()(closure)
        self.first_step()
        self.zero_grad()
        closure()
        self.second_step()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = SAM(model.parameters(), torch.optim.SGD, lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1)
mode = sys.argv[1]
for _ in range(50):
    if mode == "closure":

        def closure() -> torch.Tensor:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.zero_grad()
        closure()
        opt.step(closure)
    else:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.first_step()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.second_step()
print("done")
