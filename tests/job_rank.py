"""One rank of a pretend job, for the job-source tests: a tiny loop under ``tdbg.watch`` that takes
its rank, world size and job id from the launcher variables torchrun sets (no process group:
those tests are about reading ranks, not about collectives).

``python tests/job_rank.py JOB RANK WORLD [NAN_AT]`` runs until killed; with ``NAN_AT`` this rank's
loss turns NaN from that step on (the others stay finite: NaN on some ranks only). The run's name
is ``$RANK_NAME`` when set (torchrun's ranks all share the script's), else ``rankN``."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import tdbg


def main() -> None:
    job, rank, world = sys.argv[1], sys.argv[2], sys.argv[3]
    nan_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    os.environ.update(TORCHELASTIC_RUN_ID=job, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = tdbg.watch(model, opt, name=os.environ.get("RANK_NAME") or f"rank{rank}")
    step = 0
    while True:
        time.sleep(0.005)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if nan_at is not None and step >= nan_at:
            loss = loss * float("nan")
        step += 1
        loss.backward()
        opt.step()
        probe.step(loss)


if __name__ == "__main__":
    main()
