"""Launchers and ranks for ``tdbg run``: which process starts ranks, and which child is one."""

from __future__ import annotations

import os
import sys
from typing import Any

# Nothing heavy here: the preload asks is_launcher() at every interpreter's start-up.

# Launchers: they train nothing and start the ranks, which watch themselves (the launcher keeps
# the settings in its environment for them). By how they are started (sys.orig_argv).
LAUNCHER_COMMANDS = ("torchrun", "accelerate", "accelerate-launch", "deepspeed")
LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "accelerate.commands.accelerate_cli",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
)
# The variables that tell a rank from its parent: a child started with other values than its
# parent's (Lightning's launcher re-running the script with LOCAL_RANK=1) is another rank.
RANK_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS")


def is_launcher() -> bool:
    """This process is torchrun / ``python -m torch.distributed.run`` (or the older launch),
    accelerate's or deepspeed's launcher: it trains nothing, its ranks watch themselves."""
    # sys.orig_argv: at start-up (where this runs) `python -m X` has not set sys.argv[0] yet.
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    for i, word in enumerate(argv[:4]):
        if os.path.basename(word) in LAUNCHER_COMMANDS:
            return True
        if word == "-m" and i + 1 < len(argv):
            return argv[i + 1] in LAUNCHER_MODULES
    return False


def another_rank(env: Any) -> bool:
    """A child's environment names a rank of a job of 2 or more, not this process's own."""
    worlds = [env.get(var) for var in WORLD_VARS]
    if not any(w and w.isdigit() and int(w) > 1 for w in worlds):
        return False
    mine = [os.environ.get(var) for var in RANK_VARS]
    theirs = [env.get(var) for var in RANK_VARS]
    return any(theirs) and theirs != mine


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
