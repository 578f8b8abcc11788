"""Launchers and ranks under ``tdbg run``: who starts ranks, which child is one, who started it."""

from __future__ import annotations

import os
import sys
from typing import Any

# Nothing heavy here: the preload asks is_launcher() at every interpreter's start-up.

# Set by a launcher process for the ranks it starts, and by a watched process in the environment
# of a rank it starts itself: what started them, in the words `tdbg run` says a rank it does not
# watch was started by.
ENV_LAUNCHER = "TDBG_LAUNCHER"
# Launchers: they train nothing and start the ranks, which watch themselves (the launcher keeps
# the settings in its environment for them). By how they are started (sys.orig_argv): the
# command or module -> the launcher's name.
LAUNCHER_COMMANDS = {
    "torchrun": "torchrun",
    "accelerate": "accelerate launch",
    "accelerate-launch": "accelerate launch",
    "deepspeed": "deepspeed",
}
LAUNCHER_MODULES = {
    "torch.distributed.run": "torchrun",  # torchrun's own module
    "torch.distributed.launch": "torch.distributed.launch",
    "accelerate.commands.launch": "accelerate launch",
    "accelerate.commands.accelerate_cli": "accelerate launch",
    "deepspeed.launcher.runner": "deepspeed",
    "deepspeed.launcher.launch": "deepspeed",
}
# The variables that tell a rank from its parent: a child started with other values than its
# parent's (Lightning's launcher re-running the script with LOCAL_RANK=1) is another rank.
RANK_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS")


def launcher_name() -> str | None:
    """The launcher this process is (torchrun or ``python -m torch.distributed.run``, the older
    launch, accelerate's, deepspeed's), by its name; None for any other process."""
    # sys.orig_argv: at start-up (where this runs) `python -m X` has not set sys.argv[0] yet.
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    for i, word in enumerate(argv[:4]):
        name = LAUNCHER_COMMANDS.get(os.path.basename(word))
        if name is not None:
            return name
        if word == "-m" and i + 1 < len(argv):
            return LAUNCHER_MODULES.get(argv[i + 1])
    return None


def is_launcher() -> bool:
    """This process is a launcher: it trains nothing, its ranks watch themselves."""
    return launcher_name() is not None


def another_rank(env: Any) -> bool:
    """A child's environment names a rank of a job of 2 or more, not this process's own."""
    worlds = [env.get(var) for var in WORLD_VARS]
    if not any(w and w.isdigit() and int(w) > 1 for w in worlds):
        return False
    mine = [os.environ.get(var) for var in RANK_VARS]
    theirs = [env.get(var) for var in RANK_VARS]
    return any(theirs) and theirs != mine


def lightning() -> bool:
    """Lightning is imported here: the ranks this process starts are its DDP launcher's."""
    return any(name in sys.modules for name in ("lightning", "pytorch_lightning"))


def child_launcher(default: str) -> str:
    """What starts a rank from this process: Lightning's DDP launcher (it starts its ranks
    through a subprocess or torch.multiprocessing) when Lightning is imported, else ``default``."""
    return "Lightning DDP" if lightning() else default


def started_by(config: dict[str, Any]) -> str | None:
    """What started this process, a rank: the launcher its parent named (``config["launcher"]``:
    a launcher process, or a watched process that started it), else Lightning (whose rank 0 is
    the process `tdbg run` started), else srun (each task a rank); None when nothing says."""
    if config.get("launcher"):
        return str(config["launcher"])
    if lightning():
        return "Lightning DDP"
    tasks = os.environ.get("SLURM_NTASKS", "")
    if os.environ.get("SLURM_PROCID") and tasks.isdigit() and int(tasks) > 1:
        return "srun"
    return None


def spawn_job() -> str:
    """A job id for the ranks mp.spawn starts from here, should neither their environment nor
    their process group name one: this host and pid."""
    import socket

    master = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return ":".join(master) if all(master) else f"spawn:{socket.gethostname()}:{os.getpid()}"


def spawned_record(config: dict[str, Any]) -> str | None:
    """A rank torch.multiprocessing started records where tdbg run said, one file per rank
    (watch() itself reads TDBG_RECORD only in a process multiprocessing did not start)."""
    path = config.get("record")
    if not config.get("spawned") or not path:
        return None
    if "{rank}" in path:
        return str(path)
    root, ext = os.path.splitext(path)
    return f"{root}.rank{{rank}}{ext}"
