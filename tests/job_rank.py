"""One rank of a pretend job, for the job-source tests: a tiny loop under ``tdbg.watch`` that takes
its rank, world size and job id from the launcher variables torchrun sets (no process group:
those tests are about reading ranks, not about collectives).

``python tests/job_rank.py JOB RANK WORLD [NAME]`` runs until killed; NAME is the run's name
(default ``rankN``; torchrun's ranks all share the script's)."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import tdbg


def main() -> None:
    job, rank, world = sys.argv[1], sys.argv[2], sys.argv[3]
    name = sys.argv[4] if len(sys.argv) > 4 else f"rank{rank}"
    os.environ.update(TORCHELASTIC_RUN_ID=job, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, name=name)
    while True:
        time.sleep(0.005)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)


if __name__ == "__main__":
    main()
