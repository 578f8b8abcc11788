"""A small real run recorded to a file: the loop that tests of after-the-run outputs share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import tdbg


def record_small_run(
    model: nn.Module, opt: torch.optim.Optimizer, path: Path, steps: int, **watch: Any
) -> Path:
    """Train ``model`` on random (16, 4) batches for ``steps`` steps under ``tdbg.watch`` with
    a recording at ``path`` and no socket; closed, so the recording is whole."""
    probe = tdbg.watch(model, opt, serve=False, record=path, **watch)
    for _ in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    return path
