"""Deep dives on every rank of a job (`tdbg profile --job JOB`): the per-rank profiles compared
(tdbg/model/rank_profiles.py), and the CLI on a real torchrun + gloo job and on pretend
ranks (one killed, Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from jobs import pretend_rank
from processes import kill_tree, torchrun_job
from waiting import wait_until

from tdbg.cli.job_dives import rank_list
from tdbg.cli.main import run
from tdbg.connect.jobs import job_entries, job_ranks
from tdbg.connect.runtime import discover
from tdbg.connect.target_errors import TargetError
from tdbg.model.rank_profiles import compare_profiles, rank_profile


def _row(name: str, cpu_total: float, calls: int = 5) -> dict[str, Any]:
    return {"name": name, "calls": calls, "self_cpu": cpu_total, "cpu_total": cpu_total}


def _profile(wall: float, rows: list[dict[str, Any]], steps: tuple[int, int] = (10, 14)) -> Any:
    return {"rows": rows, "steps": list(steps), "wall_seconds": wall, "sort": "cpu_total"}


# --- the comparison, as plain data ------------------------------------------------------------


def test_the_straggler_is_the_rank_the_others_wait_for_not_the_longest_wall_time() -> None:
    """In lockstep every rank's wall time is alike (here the fast rank's is even longer); the
    fast rank spent it waiting in the all-reduce, so the other one is the slowest."""
    fast = _profile(0.232, [_row("gloo:all_reduce", 225_000.0), _row("aten::addmm", 200.0)])
    slow = _profile(0.215, [_row("gloo:all_reduce", 7_000.0), _row("aten::addmm", 300.0)])
    comparison = compare_profiles({0: fast, 1: slow})
    assert comparison is not None
    assert (comparison.slowest.rank, comparison.fastest.rank) == (1, 0)
    assert comparison.slowest.own == pytest.approx((0.215 - 0.007) / 5)
    assert comparison.fastest.waited == pytest.approx(0.045)
    # The fast rank's extra all-reduce time is its wait for the slow one, not a cause: the
    # biggest difference named is in the ranks' own work.
    biggest = comparison.biggest_difference()
    assert biggest is not None and biggest.name == "aten::addmm"
    assert biggest.difference == pytest.approx((300.0 - 200.0) / 5)
    line = comparison.biggest_difference_line()
    assert line is not None and line.startswith("biggest difference in own work: aten::addmm")
    assert "on rank 1 than on rank 0" in line


def test_ops_are_aligned_by_name_and_an_op_on_one_side_only_is_kept() -> None:
    slow = _profile(1.0, [_row("aten::conv2d", 90_000.0), _row("aten::relu", 5_000.0)])
    fast = _profile(0.5, [_row("aten::relu", 4_000.0), _row("aten::copy_", 1_000.0)])
    comparison = compare_profiles({3: fast, 7: slow})
    assert comparison is not None and comparison.slowest.rank == 7
    by_name = {op.name: op for op in comparison.ops}
    assert [op.name for op in comparison.ops] == ["aten::conv2d", "aten::relu", "aten::copy_"]
    assert by_name["aten::relu"].slow_us == 1_000.0 and by_name["aten::relu"].fast_us == 800.0
    assert by_name["aten::conv2d"].fast is None and by_name["aten::copy_"].slow is None
    assert comparison.biggest_difference() is by_name["aten::conv2d"]


def test_per_step_figures_make_ranks_with_fewer_profiled_steps_comparable() -> None:
    """A rank cut short by --max-seconds profiled fewer steps: it is compared per step."""
    short = _profile(0.3, [], steps=(10, 12))  # 3 steps, 100 ms each
    long = _profile(0.5, [], steps=(10, 14))  # 5 steps, 100 ms each
    unknown: dict[str, list[object]] = {"rows": [], "steps": []}
    comparison = compare_profiles({0: long, 1: short, 2: unknown})
    assert comparison is not None
    assert [p.rank for p in comparison.ranks] == [0, 1, 2]  # a tie: lower rank; unknown last
    assert rank_profile(1, short).wall == pytest.approx(0.1)
    assert compare_profiles({}) is None


def test_ranks_option_and_an_unknown_job() -> None:
    assert rank_list("0,2") == [0, 2] and rank_list("3-5,0") == [0, 3, 4, 5]
    for bad in ("", "a", "-1", "3-1"):
        with pytest.raises(Exception, match="ranks are numbers"):
            rank_list(bad)
    with pytest.raises(TargetError, match="no rank of job x is running here"):
        job_ranks("x", [])


# --- the CLI on real ranks --------------------------------------------------------------------


def _the_job(ranks: int) -> str:
    """The job id once ``ranks`` ranks of one job serve in the runtime directory."""
    jobs = wait_until(
        lambda: {j: r for j, r in job_entries(discover()).items() if len(r) == ranks},
        120,
        f"{ranks} ranks of a job serving",
    )
    return next(iter(jobs))


@pytest.mark.slow
def test_profile_of_a_torchrun_job_names_the_slow_rank_and_ranks_chooses(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gloo ranks, rank 1's data loader slow: both ranks' profiles come back with their
    rank, rank 1 the slowest and rank 0 the fastest; --ranks 1 profiles rank 1 only."""
    with torchrun_job(2, DDP_STEPS="100000", DDP_SLOW_RANK="1"):
        job = _the_job(2)
        assert run(["profile", "--job", job, "--steps", "5", "--json"]) == 0
        value = json.loads(capsys.readouterr().out)
        assert value["job"] == job and [r["rank"] for r in value["ranks"]] == [0, 1]
        assert all(r["rows"] and r["steps"] for r in value["ranks"])
        assert (value["slowest"], value["fastest"]) == (1, 0)

        assert run(["profile", "--job", job, "--steps", "3", "--rows", "5"]) == 0
        text = capsys.readouterr().out
        assert "slowest rank 1: steps " in text and "fastest rank 0: steps " in text
        assert "rank 1 trace: " in text and "rank 0 trace: " in text
        assert "gloo:all_reduce" in text  # the op rank 0 waits in

        assert run(["nan-hunt", "--job", job, "--ranks", "1", "--steps", "1", "--json"]) == 0
        value = json.loads(capsys.readouterr().out)
        assert [(r["rank"], r["found"]) for r in value["ranks"]] == [(1, False)]


@pytest.mark.slow
def test_a_killed_rank_is_one_line_and_the_others_answer(
    runtime_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pretend_rank(runtime_dir, "j1", 0, 2), pretend_rank(runtime_dir, "j1", 1, 2) as rank1:
        _the_job(2)
        kill_tree(rank1)
        assert run(["nan-hunt", "--job", "j1", "--steps", "1"]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("--- rank 0\nno non-finite value in 1 step")
        assert "--- rank 1" not in captured.out
        errors = [line for line in captured.err.splitlines() if "rank 1" in line]
        assert len(errors) == 1 and errors[0].startswith("tdbg: error: rank 1: ")
        # No rank answers: say so, exit 2.
        assert run(["nan-hunt", "--job", "j1", "--ranks", "1", "--steps", "1"]) == 2
        assert "no rank of job j1 answered" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_cancels_the_dive_on_every_rank(runtime_dir: Path) -> None:
    with pretend_rank(runtime_dir, "j2", 0, 2), pretend_rank(runtime_dir, "j2", 1, 2):
        _the_job(2)
        argv = ["profile", "--job", "j2", "--steps", "200", "--max-seconds", "100", "--progress"]
        dive = subprocess.Popen(
            [sys.executable, "-m", "tdbg.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
            start_new_session=True,  # as the ranks: kill_tree ends it whole
        )
        lines: list[str] = []
        assert dive.stderr is not None
        stderr = dive.stderr
        reader = threading.Thread(target=lambda: lines.extend(iter(stderr.readline, "")))
        reader.start()
        try:
            wait_until(
                lambda: (
                    {r for r in (0, 1) if any(f"rank {r}: profile job" in s for s in lines)}
                    == {0, 1}
                    and all(
                        any(f"rank {r}: " in s and "running" in s for s in lines) for r in (0, 1)
                    )
                ),
                60,
                "both ranks profiling",
                detail=lambda: "".join(lines),
            )
            dive.send_signal(signal.SIGINT)
            assert dive.wait(60) == 130
        finally:
            kill_tree(dive)
            reader.join(10)
        assert "tdbg: interrupted: cancelled on ranks [0, 1]\n" in lines, "".join(lines)
