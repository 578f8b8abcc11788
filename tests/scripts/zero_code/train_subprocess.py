"""Starts python children, as a script running an evaluation would: one before it imports torch,
one after its first backward. The second is even handed the preload (worst case) and calls
watch(serve=False) itself; each prints what it sees (child_report.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def child(env: dict[str, str] | None = None) -> dict[str, object]:
    argv = [sys.executable, "child_report.py"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def main() -> None:
    before = child()
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    env = dict(os.environ, PYTHONPATH=os.environ["ZC_SPAWN_PRELOAD"], ZC_CHILD_TRAINS="1")
    after = child(env)
    print(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
