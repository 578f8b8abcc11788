"""``benchmarks/entry_cost.py`` still measures what it says on this torch: it reaches each timing
point it puts inside torch's calls (it exits non-zero where torch calls differently). Its
figures are the benchmark's job (benchmarks/README.md), not a test's: only that it runs and
prints one row per span."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from waiting import TIMEOUT

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str, runtime_dir: Path) -> str:
    # The benchmarks make a runtime dir of their own (tempfile): inside the test's, removed.
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir), TMPDIR=str(runtime_dir))
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_entry_cost_reaches_every_timing_point_and_shows_each_span(runtime_dir: Path) -> None:
    out = _run("entry_cost.py", "--models", "cnn", "--pairs", "20", runtime_dir=runtime_dir)
    spans = [line.split("  ")[1].strip() for line in out.splitlines() if " us +- " in line]
    assert spans == ["forward", "backward", "optimizer pre", "optimizer post", "probe.step()"]
    # The probe's hooks went back in: its timed cost was read from the watched steps.
    assert "the probe timed" in out and "sum / timed" in out
