"""DDP on gloo, two ranks started by torch.multiprocessing.spawn (or start_processes with
LAUNCH_START_METHOD); tdbg-free. LAUNCH_INIT=tcp: init_method tcp:// (no MASTER_* variables)."""

from __future__ import annotations

import os

import common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def work(rank: int, world: int, port: str) -> None:
    if os.environ.get("LAUNCH_INIT") == "tcp":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    else:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(common.model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in common.loader(rank):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        common.evaluate_in_a_subprocess()
    common.hold()
    dist.destroy_process_group()
    common.done(rank, losses)


def main() -> None:
    port = os.environ.get("LAUNCH_PORT", "29533")
    method = os.environ.get("LAUNCH_START_METHOD")
    if method:
        mp.start_processes(work, args=(2, port), nprocs=2, start_method=method)
    else:
        mp.spawn(work, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
