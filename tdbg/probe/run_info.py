"""Who this run is: its rank and place in a distributed job, and the ``hello`` run description."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
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


# Set by `tdbg run` in a rank that torch.multiprocessing started (mp.spawn, start_processes):
# the process index, the number of processes and a job id, for when neither the environment nor
# an initialised process group says where the process sits (see place()).
_spawned: JobPlace = {}
# Set by `tdbg run` in a process it watches: what started it (a launcher it recognised: RunInfo's
# ``launcher``), asked when a probe starts.
started_by: Callable[[], str | None] | None = None


def set_spawned(index: int, nprocs: int, job: str) -> None:
    """This process is process ``index`` of ``nprocs`` that torch.multiprocessing started."""
    _spawned.update({"rank": index, "local_rank": index, "world_size": nprocs, "job": job})


def rank() -> int:
    """This process's rank: the job's (see :func:`place`), else RANK, else LOCAL_RANK, else 0."""
    found = place().get("rank")
    if found is not None:
        return found
    for var in ("RANK", "LOCAL_RANK"):
        value = _env_int(var)
        if value is not None:
            return value
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


def _master() -> str:
    master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return ":".join(master) if all(master) else ""


def _store_address() -> str:
    """host:port of the default process group's TCP store (``init_method="tcp://..."``): what
    every rank of the job shares when the environment names no master. Local reads only."""
    try:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore
            store = store.underlying_store
        host, port = getattr(store, "host", ""), getattr(store, "port", 0)
        return f"{host}:{port}" if host and port else ""
    except Exception:
        return ""


def _slurm_job() -> str:
    job, step = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_STEP_ID", "")
    return f"slurm:{job}.{step}" if job and step else f"slurm:{job}" if job else ""


def place() -> JobPlace:
    """Where this process sits in a distributed job; {} for a single process. Asked once, when
    a probe starts; no collective, nothing waited for. The first source that names a world of
    2 or more processes wins:

    - ``RANK``/``WORLD_SIZE`` (torchrun, ``python -m torch.distributed.run``/``.launch``,
      ``accelerate launch``, deepspeed): the job is torchrun's run id, else MASTER_ADDR:PORT;
    - an initialised default process group (mp.spawn and friends pass rank and world size to
      ``init_process_group``, not to the environment): MASTER_ADDR:PORT, else its TCP store's
      (SLURM's job when srun's tasks are its ranks);
    - ``LOCAL_RANK``/``WORLD_SIZE`` on node 0 (Lightning's launcher: its ranks get no RANK);
    - ``SLURM_PROCID``/``SLURM_NTASKS`` (srun: each task a rank): the job is
      ``slurm:JOB.STEP`` (SLURM_JOB_ID, SLURM_STEP_ID);
    - the process index and count of a rank ``tdbg run`` saw torch.multiprocessing start.
    """
    local = _env_int("LOCAL_RANK")
    world = _env_int("WORLD_SIZE")
    env_rank = _env_int("RANK")
    if world is not None and world > 1 and env_rank is not None:
        job = os.environ.get("TORCHELASTIC_RUN_ID") or ""
        if not job or job == "none":
            job = _master()
        info: JobPlace = {"world_size": world, "job": job, "rank": env_rank}
        if local is not None:
            info["local_rank"] = local
        return info
    group = _process_group()
    if group is not None and group[1] > 1:
        info = {"world_size": group[1], "job": _master() or _store_address(), "rank": group[0]}
        if local is not None:
            info["local_rank"] = local
        elif _spawned.get("world_size") == group[1]:
            info["local_rank"] = _spawned["local_rank"]
        if _env_int("SLURM_NTASKS") == group[1] and os.environ.get("SLURM_JOB_ID"):
            info["job"] = _slurm_job()  # srun's tasks are the ranks: the job is SLURM's
        if not info["job"] and _spawned:
            info["job"] = _spawned["job"]
        return info
    if world is not None and world > 1 and local is not None:
        if (_env_int("NODE_RANK") or 0) == 0:
            return {"world_size": world, "job": _master(), "rank": local, "local_rank": local}
        return {"world_size": world, "job": _master(), "local_rank": local}
    tasks, task = _env_int("SLURM_NTASKS"), _env_int("SLURM_PROCID")
    if tasks is not None and tasks > 1 and task is not None:
        info = {"world_size": tasks, "job": _slurm_job(), "rank": task}
        slurm_local = _env_int("SLURM_LOCALID")
        if slurm_local is not None:
            info["local_rank"] = slurm_local
        return info
    if _spawned.get("world_size", 0) > 1:
        return JobPlace(**_spawned)
    if world is not None and world > 1:
        return {"world_size": world, "job": _master()}
    return {}


def job_info() -> JobPlace:
    """:func:`place` (kept by this name: the recording's path asks whether there is a job)."""
    return place()


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
        **place(),
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
    launcher = _launcher()
    if launcher and "world_size" in run_info:
        run_info["launcher"] = launcher
    return run_info, unavailable


def _launcher() -> str | None:
    try:
        return started_by() if started_by is not None else None
    except Exception:
        return None


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
