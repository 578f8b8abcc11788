"""Light pretend ranks of a job for the tests (tests/job_rank.py), each ended whole with
kill_tree when the test is done with it; a real torchrun job is processes.torchrun_job."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from processes import kill_tree

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


def pretend_rank(
    runtime: Path,
    job: str,
    number: int,
    world: int,
    nan_at: int | None = None,
    name: str | None = None,
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """Rank ``number`` of job ``job`` as tests/job_rank.py plays it, serving in ``runtime``;
    ``nan_at``: its loss is NaN from that step on; ``name``: the run's name (default ``rankN``),
    as torchrun's ranks all share the script's."""
    argv = [sys.executable, str(RANK_SCRIPT), job, str(number), str(world)]
    if nan_at is not None:
        argv.append(str(nan_at))
    env = {"TDBG_RUNTIME_DIR": str(runtime)}
    if name is not None:
        env["RANK_NAME"] = name
    return _started(argv, env)
