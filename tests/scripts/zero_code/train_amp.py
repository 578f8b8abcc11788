"""AMP on CPU: bf16 autocast and a GradScaler whose scale grows every 2 steps; one iteration's
gradients are made infinite, so the scaler skips that optimizer step and halves its scale."""

from __future__ import annotations

import json

import torch
from torch import nn

SKIPPED = 4  # the iteration whose optimizer step the scaler skips


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    first = nn.Linear(8, 16)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    losses, scales, taken = [], [], []
    for i in range(12):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if i == SKIPPED:
            assert first.weight.grad is not None
            first.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        taken.append(scaler.get_scale() >= scales[-1])  # a skipped step halves the scale
    print(json.dumps({"losses": losses, "scales": scales, "taken": taken}))


if __name__ == "__main__":
    main()
