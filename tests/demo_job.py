"""Start a demo training script in a subprocess with its own runtime dir, and wait for its probe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tdbg.connect.runtime import RunEntry

ROOT = Path(__file__).resolve().parent.parent
DEMOS = ROOT / "demos"
sys.path.insert(0, str(DEMOS))

from launch import wait_for_probe  # noqa: E402


@contextmanager
def demo_job(
    script: str, *args: str, runtime: Path, timeout: float = 60.0
) -> Iterator[tuple[subprocess.Popen[bytes], RunEntry]]:
    """Run ``demos/<script>.py ARGS`` serving into ``runtime``; yield once its probe is up."""
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(DEMOS / f"{script}.py"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        entry = wait_for_probe(proc, runtime, timeout)  # the demo launcher's own wait
        if entry is None:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise AssertionError(f"{script} exited with {proc.returncode}: {err[-2000:]}")
            raise AssertionError(f"{script} did not start serving within {timeout:g} s")
        yield proc, entry
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.stderr:
            proc.stderr.close()
