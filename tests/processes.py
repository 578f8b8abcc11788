"""Ending a launched job whole: torchrun starts each worker in a session of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group and every process below it, then reap ``proc``.

    Killing the launcher's group is not enough for torchrun: its elastic agent starts each rank
    with ``start_new_session``, so the ranks sit in groups of their own and, their agent killed
    before it could stop them, train on as orphans (seen: ranks of a 100,000-step job still
    running long after their test, loading every test after it)."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        below = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(below, timeout=30)
    proc.wait(30)
