"""DDP on gloo with its place read from SLURM's variables, as under `srun` (each task a rank);
tdbg-free."""

from __future__ import annotations

import os

import common
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    port = os.environ.get("LAUNCH_PORT", "29534")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = DistributedDataParallel(common.model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in common.loader(rank):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.destroy_process_group()
    common.done(rank, losses)


if __name__ == "__main__":
    main()
