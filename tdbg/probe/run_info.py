"""Who this run is: its rank and place in a distributed job, and the ``hello`` run description."""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TypedDict

import torch
from torch import nn

from tdbg.protocol.messages.run import RunInfo, WatchedOptimizer
from tdbg.protocol.stall import DEFAULT_STALL_RULE


class JobPlace(TypedDict, total=False):
    """Where a process sits in a distributed job (RunInfo's job fields); empty for one process."""

    world_size: int
    job: str
    local_rank: int
    rank: int


def rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0


def _env_int(var: str) -> int | None:
    try:
        return int(os.environ[var])
    except (KeyError, ValueError):
        return None


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of an initialised default process group, else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None


def job_info() -> JobPlace:
    """Where this process sits in a distributed job, from the launcher's environment (torchrun,
    torch.distributed.run, mpirun-style RANK/WORLD_SIZE); {} for a single process."""
    world = _env_int("WORLD_SIZE")
    if world is None:
        group = _process_group()
        if group is not None and group[1] > 1:
            # mp.spawn and friends pass rank and world size to init_process_group, not the
            # environment: read them from torch.distributed (local calls, no collective).
            master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
            job = ":".join(master) if all(master) else ""
            return {"world_size": group[1], "job": job, "rank": group[0]}
    if world is None or world < 2:
        return {}
    job = os.environ.get("TORCHELASTIC_RUN_ID") or ""
    if not job or job == "none":
        master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        job = ":".join(master) if all(master) else ""
    info: JobPlace = {"world_size": world, "job": job}
    local = _env_int("LOCAL_RANK")
    if local is not None:
        info["local_rank"] = local
    return info


def describe_run(
    name: str,
    cuda_device: torch.device | None,
    models: list[tuple[str, nn.Module]],
    optimizers: list[tuple[str, torch.optim.Optimizer]],
) -> tuple[RunInfo, dict[str, str]]:
    """The ``hello`` message's run description, and the commands this run cannot serve (why)."""
    unavailable: dict[str, str] = {}
    if cuda_device is None:
        unavailable["snapshot"] = (
            "memory snapshots record the CUDA allocator: this run's model is on the cpu"
        )
    run_info: RunInfo = {
        "name": name,
        "pid": os.getpid(),
        "rank": rank(),
        **job_info(),
        "host": socket.gethostname(),
        "argv": [str(a)[:200] for a in sys.argv[:32]],
        "start_time": time.time(),
        "cwd": os.getcwd(),
        "torch": torch.__version__,
        "device": str(cuda_device or "cpu"),
        "commands": unavailable,
        "models": [model_name for model_name, _ in models],
        "optimizers": [watched_optimizer(opt_name, opt) for opt_name, opt in optimizers],
        "param_groups": sum(len(opt.param_groups) for _, opt in optimizers),
        # The rule this probe's own ``stalled`` alert follows: every reader judges a gap by it.
        "stall": DEFAULT_STALL_RULE.to_wire(),
    }
    return run_info, unavailable


def watched_optimizer(name: str, optimizer: torch.optim.Optimizer) -> WatchedOptimizer:
    return {"name": name, "type": type(optimizer).__name__, "groups": len(optimizer.param_groups)}


def schedule_length(optimizers: list[torch.optim.Optimizer]) -> int | None:
    """The total steps a OneCycleLR driving one of ``optimizers`` was built for (the one
    scheduler whose length is the run's, by construction); None when there is none. Found
    once, at watch(), among what refers to the optimizer (a scheduler keeps a reference)."""
    if not optimizers:
        return None
    import gc

    try:
        from torch.optim.lr_scheduler import OneCycleLR

        for optimizer in optimizers:
            for ref in gc.get_referrers(optimizer):
                # The scheduler itself, or its attribute dict (how Python may hold it): only a
                # dict that looks like a OneCycleLR's is worth a second scan of the heap.
                if isinstance(ref, dict):
                    looks = ref.get("optimizer") is optimizer and "total_steps" in ref
                    owners = gc.get_referrers(ref) if looks else []
                else:
                    owners = [ref]
                for owner in owners:
                    total = (
                        getattr(owner, "total_steps", None)
                        if isinstance(owner, OneCycleLR)
                        else None
                    )
                    if isinstance(total, int) and total > 0:
                        return total
    except Exception:
        return None
    return None
