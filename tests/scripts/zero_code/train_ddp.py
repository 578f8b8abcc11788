"""A tiny DDP loop for torchrun with gloo on CPU; tdbg-free (run it under `tdbg run`).

DDP_SLOW_RANK=r: that rank waits 40 ms for each batch (a slow data loader);
DDP_DIVERGE_RANK=r: that rank changes one layer's gradient after the all-reduce (as a broken
comm hook would), so its update differs from the others';
DDP_HANG_RANK=r: at step 5 that rank waits (up to 10 minutes) for a batch that never comes,
so the others wait for it in the all-reduce: a hung job;
DDP_RAISE_RANK=r: that rank raises (an uncaught error: it exits 1) once the file named by
DDP_RAISE_WHEN exists (at step 5 when none is named)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wait_for_a_batch_that_never_comes() -> None:
    time.sleep(600)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    slow = int(os.environ.get("DDP_SLOW_RANK", "-1")) == rank
    diverge = int(os.environ.get("DDP_DIVERGE_RANK", "-1")) == rank
    hang = int(os.environ.get("DDP_HANG_RANK", "-1")) == rank
    fail = int(os.environ.get("DDP_RAISE_RANK", "-1")) == rank
    trigger = os.environ.get("DDP_RAISE_WHEN", "")
    torch.manual_seed(100 + rank)  # each rank its own data
    for step in range(int(os.environ.get("DDP_STEPS", "6"))):
        if slow:
            time.sleep(0.04)
        if hang and step == 5:
            wait_for_a_batch_that_never_comes()
        if fail and (os.path.exists(trigger) if trigger else step == 5):
            raise RuntimeError(f"rank {rank} fails on purpose")
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if diverge:
            with torch.no_grad():
                last = net[2]
                assert isinstance(last, nn.Linear) and last.weight.grad is not None
                last.weight.grad.add_(0.5)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
