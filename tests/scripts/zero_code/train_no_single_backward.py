"""Loops whose gradients come from no single ``loss.backward()``: ``torch.autograd.backward``
of two losses at once (multi-task), or ``torch.autograd.grad`` with ``.grad`` set by hand
(meta-learning, ``torch.func`` style). Prints the truth as JSON: each step's loss (the sum of
the two, or the one) and its total gradient norm."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(48, 6), torch.randn(48, 2)
    losses, norms = [], []
    for _ in range(8):
        optimizer.zero_grad()
        out = model(x)
        first = nn.functional.mse_loss(out[:, 0], y[:, 0])
        second = nn.functional.mse_loss(out[:, 1], y[:, 1])
        if mode == "multi":
            torch.autograd.backward([first, second])
            loss = first + second
        else:
            loss = first + second
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
        norms.append(
            float(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])
                )
            )
        )
        losses.append(loss.item())
        optimizer.step()
    print(json.dumps({"losses": losses, "norms": norms}))


if __name__ == "__main__":
    main()
