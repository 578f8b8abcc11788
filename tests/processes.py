"""Launching a torchrun job under `tdbg run`, and ending it whole: torchrun starts each worker
in a session of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

SCRIPTS = Path(__file__).resolve().parent / "scripts" / "zero_code"


@contextlib.contextmanager
def torchrun_job(
    ranks: int,
    *run_options: str,
    torchrun: tuple[str, ...] = (),
    output: Any = subprocess.DEVNULL,
    **env: str,
) -> Iterator[subprocess.Popen[bytes]]:
    """`tdbg run RUN_OPTIONS -- python -m torch.distributed.run TORCHRUN
    --nproc_per_node=RANKS train_ddp.py` (the DDP loop of tests/scripts/zero_code, steered by
    ``env``), running until the test is done with it; then the launcher and every rank are
    killed (:func:`kill_tree`). ``torchrun``: more launcher options (``--nnodes=2`` ...);
    ``output``: where the launcher's stderr goes (its stdout is dropped)."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "tdbg.cli", "run", *run_options, "--"),
            *(sys.executable, "-m", "torch.distributed.run", *torchrun),
            *(f"--nproc_per_node={ranks}", "train_ddp.py"),
        ],
        cwd=SCRIPTS,
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=output,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGKILL ``proc``'s process group and every process below it, then reap ``proc``.

    Killing the launcher's group is not enough for torchrun: its elastic agent starts each rank
    with ``start_new_session``, so the ranks sit in groups of their own and, their agent killed
    before it could stop them, train on as orphans (seen: ranks of a 100,000-step job still
    running long after their test, loading every test after it). The launcher's group is
    stopped first, so that no rank it is still starting (a test that ends early) is missed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGSTOP)
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


def recorded_torchrun_job(tmp_path: Path, ranks: int, steps: int, **env: str) -> list[Path]:
    """A ``steps``-step torchrun job under `tdbg run --record`, run to its end; the ranks'
    recordings (``job.rank{r}.tdbg`` in ``tmp_path``)."""
    options = ("--record", str(tmp_path / "job.tdbg"), "--grad-every", "1")
    env = {"DDP_STEPS": str(steps), **env}
    # env holds environment variables (DDP_*, TDBG_*), never torchrun_job's own keywords.
    with torchrun_job(ranks, *options, output=subprocess.PIPE, **env) as job:  # type: ignore[arg-type]
        _, err = job.communicate(timeout=240)
    assert job.returncode == 0, err.decode(errors="replace")[-3000:]
    return [tmp_path / f"job.rank{r}.tdbg" for r in range(ranks)]
