"""Loops whose gradients come from no single ``loss.backward()``: ``torch.autograd.backward``
of two losses at once (multi-task; ``multi-amp``: each scaled by GradScaler, ``multi-amp-list``:
``scaler.scale([a, b])``), or ``torch.autograd.grad`` with ``.grad`` set by hand
(meta-learning, ``torch.func`` style; ``grad-own-watch``: the script watches itself,
``grad-global-hook``: another tool's global optimizer pre-hook after tdbg's; ``func``:
``torch.func.grad`` over ``functional_call``; ``compiled-loss``: the forward inside a
``fullgraph=True`` compiled function). Prints the truth
as JSON: each update's loss (the sum of the two) and its total gradient norm."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def loss_of(params: dict[str, torch.Tensor], model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    out = torch.func.functional_call(model, params, (x,))
    return nn.functional.mse_loss(out[:, 0], y[:, 0]) + nn.functional.mse_loss(out[:, 1], y[:, 1])


@torch.compile(backend="eager", fullgraph=True)
def compiled_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.mse_loss(out[:, 0], y[:, 0]) + nn.functional.mse_loss(out[:, 1], y[:, 1])


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    probe = None
    if mode == "grad-own-watch":
        import tdbg

        probe = tdbg.watch(model, optimizer)
    if mode == "grad-global-hook":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda *args: None)
    x, y = torch.randn(48, 6), torch.randn(48, 2)
    losses, norms = [], []
    for _ in range(8):
        optimizer.zero_grad()
        if mode in ("func", "compiled-loss"):  # the model is called only there
            first = second = loss = torch.zeros(())
        else:
            out = model(x)
            first = nn.functional.mse_loss(out[:, 0], y[:, 0])
            second = nn.functional.mse_loss(out[:, 1], y[:, 1])
            loss = first + second
        if mode == "multi":
            torch.autograd.backward([first, second])
        elif mode == "multi-amp":
            torch.autograd.backward([scaler.scale(first), scaler.scale(second)])
        elif mode == "multi-amp-list":
            torch.autograd.backward(scaler.scale([first, second]))
        elif mode == "func":  # torch.func: the model runs on stand-ins for its parameters
            grads = torch.func.grad(loss_of)(dict(model.named_parameters()), model, x, y)
            for name, param in model.named_parameters():
                param.grad = grads[name]
        elif mode == "compiled-loss":  # the forward runs inside a graph dynamo traces
            grads = torch.autograd.grad(compiled_loss(model, x, y), list(model.parameters()))
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
        else:
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
        if mode.startswith("multi-amp"):
            scaler.unscale_(optimizer)
        norms.append(
            float(
                torch.linalg.vector_norm(
                    torch.stack(
                        [
                            torch.linalg.vector_norm(p.grad.detach())
                            for p in model.parameters()
                            if p.grad is not None
                        ]
                    )
                )
            )
        )
        losses.append(loss.item())
        if mode.startswith("multi-amp"):
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if probe is not None:
            probe.step(loss)
    print(json.dumps({"losses": losses, "norms": norms}))


if __name__ == "__main__":
    main()
