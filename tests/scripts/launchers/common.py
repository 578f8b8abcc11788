"""The one tiny model and loop the launcher scripts share; tdbg-free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from torch import nn


def model() -> nn.Module:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def steps() -> int:
    return int(os.environ.get("LAUNCH_STEPS", "6"))


def loader(rank: int) -> torch.utils.data.DataLoader:
    """Each rank its own data; LAUNCH_WORKERS=1: a DataLoader worker (a non-rank child)."""
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.utils.data.TensorDataset(
        torch.randn(16 * steps(), 4, generator=g), torch.randn(16 * steps(), 1, generator=g)
    )
    workers = int(os.environ.get("LAUNCH_WORKERS", "0"))
    return torch.utils.data.DataLoader(data, batch_size=16, num_workers=workers)


def evaluate_in_a_subprocess() -> None:
    """LAUNCH_EVAL=1: an evaluation subprocess (a non-rank child) that trains a model of its
    own for two steps: under tdbg run it must stay inert (no socket, no recording)."""
    if os.environ.get("LAUNCH_EVAL") != "1":
        return
    code = (
        "import torch; m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), 0.1)\n"
        "for _ in range(2):\n    m(torch.ones(1, 2)).sum().backward(); o.step()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def hold() -> None:
    """LAUNCH_HOLD=PATH: wait (up to 2 minutes) for PATH to exist, the job still live."""
    path = os.environ.get("LAUNCH_HOLD")
    for _ in range(1200):
        if not path or os.path.exists(path):
            return
        time.sleep(0.1)


def done(rank: int, losses: list[float]) -> None:
    print(json.dumps({"rank": rank, "losses": losses}), flush=True)
