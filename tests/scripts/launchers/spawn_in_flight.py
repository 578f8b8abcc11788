"""Five gloo ranks by torch.multiprocessing.spawn end with a collective in flight (an allgather
not waited for) and their group left initialised: pytorch/pytorch#190489's shape, which aborts a
rank at its end ("terminate called without an active exception") unless the group is destroyed
while the interpreter is whole; tdbg-free."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 5


def work(rank: int, port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out = [torch.empty(1) for _ in range(WORLD)]
    group = dist.group.WORLD
    assert group is not None
    group.allgather([out], [torch.tensor([rank * 100.0])])  # not waited for


if __name__ == "__main__":
    mp.spawn(work, args=(os.environ.get("LAUNCH_PORT", "29534"),), nprocs=WORLD)
