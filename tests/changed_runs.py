"""Real runs whose model changes under the probe (a head replaced mid-run), shared by the probe's
tests and the TUI's: what a client that attaches late is sent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from conftest import Reader

import tdbg


def small_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 4), torch.randn(32, 1) * 5


def changed_run(steps: int, change: Callable[[int, Any], torch.optim.Optimizer | None]) -> Any:
    """``small_model()`` trained ``steps`` steps under a probe sampling every step, SGD at 0.05;
    before each step ``change(step, model)`` may alter the model and return the optimizer from
    then on. Returns the probe."""
    model = small_model()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = fixed_batch()
    probe = tdbg.watch(model, opt, grad_every=1)
    for step in range(steps):
        opt = change(step, model) or opt
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    return probe


def replaced_head_run(
    runtime_dir: Path, before: int = 3, after: int = 3, nan_grad_at: int | None = None
) -> list[dict]:
    """A real run whose head is replaced (and its optimizer) after ``before`` steps: what a
    client that attaches once it ran ``after`` more is sent (its history, as a TUI gets it).
    Layers ["0", "2" (the old head: gone), "2.0", "2.1" (the new one, from step ``before``)].
    ``nan_grad_at``: the old head's weight gets a NaN gradient at that step (only it)."""

    def change(step: int, model: Any) -> torch.optim.Optimizer | None:
        if step == nan_grad_at:
            model[2].weight.register_hook(lambda g: g * float("nan"))
        if step != before:
            return None
        model[2] = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
        return torch.optim.SGD(model.parameters(), lr=0.2)

    probe = changed_run(before + after, change)
    late = Reader(probe.socket_path)  # type: ignore[arg-type]
    late.wait(lambda r: len(r.records()) >= before + after and bool(r.of("layers")))
    late.close()
    return list(late.messages)
