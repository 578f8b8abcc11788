"""Distributed jobs for the tests: a real torchrun under `tdbg run`, or light pretend ranks
(tests/job_rank.py); each ended whole with kill_tree when the test is done with it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from processes import kill_tree

SCRIPTS = Path(__file__).resolve().parent / "scripts" / "zero_code"
RANK_SCRIPT = Path(__file__).resolve().parent / "job_rank.py"


@contextmanager
def _started(
    argv: list[str], env: dict[str, str], cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in a session of its own, quiet, killed whole (kill_tree) afterwards."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        kill_tree(proc)


def tdbg_torchrun(
    *torchrun_args: str, **env: str
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """`tdbg run --grad-every 1 -- python -m torch.distributed.run ARGS train_ddp.py` (the DDP
    loop of tests/scripts/zero_code, steered by ``env``), running until the test is done."""
    argv = [sys.executable, "-m", "tdbg.cli", "run", "--grad-every", "1", "--", sys.executable]
    argv += ["-m", "torch.distributed.run", *torchrun_args, "train_ddp.py"]
    return _started(argv, env, SCRIPTS)


def pretend_rank(
    runtime: Path, job: str, number: int, world: int
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """Rank ``number`` of job ``job`` as tests/job_rank.py plays it, serving in ``runtime``."""
    argv = [sys.executable, str(RANK_SCRIPT), job, str(number), str(world)]
    return _started(argv, {"TDBG_RUNTIME_DIR": str(runtime)})
