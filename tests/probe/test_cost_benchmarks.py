"""``benchmarks/entry_cost.py`` still measures what it says on this torch: it reaches each timing
point it puts inside torch's calls (it exits non-zero where torch calls differently); and
``benchmarks/step_ab.py`` still loads a revision's sampler beside the working tree's; and
``benchmarks/step_parts.py`` still finds each entry point it takes out. Their
figures are the benchmark's job (benchmarks/README.md), not a test's: only that they run and
print what they measure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from waiting import TIMEOUT

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


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


def test_step_ab_times_two_revisions_of_the_step_against_each_other(runtime_dir: Path) -> None:
    out = _run("step_ab.py", "HEAD", "worktree", "--pairs", "20", runtime_dir=runtime_dir)
    assert "A (HEAD) median" in out and "B (worktree) median" in out and " A - B " in out


def test_step_parts_takes_each_entry_point_out_and_shows_what_it_costs(runtime_dir: Path) -> None:
    out = _run("step_parts.py", "--cycles", "3", "--steps", "2", runtime_dir=runtime_dir)
    rows = [
        line.split(" us +- ")[0].rsplit(None, 1)[0].strip()
        for line in out.splitlines()
        if " us +- " in line
    ]
    assert "watched - unwatched" in rows
    for part in ("forward", "backward", "optimizer pre", "optimizer post", "any optimizer"):
        assert f"watched - (watched - {part})" in rows
    assert "watched - (watched - probe.step())" in rows and "watched - probe thread idle" in rows
