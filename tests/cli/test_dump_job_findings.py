"""`tdbg dump --job` carries the job's findings as `job_alert` events, judged by the rules the job
screen uses (tdbg.model.job_alerts), so scripts and alerting read what a person sees."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from jobs import pretend_rank
from test_cli import TDBG, events, run_cli
from waiting import wait_until

from tdbg.connect.runtime import discover


@pytest.mark.slow
def test_nan_on_one_rank_only_is_a_job_alert_in_the_dump(runtime_dir: Path) -> None:
    with ExitStack() as stack:
        stack.enter_context(pretend_rank(runtime_dir, "jobN", 0, 2))
        stack.enter_context(pretend_rank(runtime_dir, "jobN", 1, 2, nan_at=3))
        wait_until(lambda: len(discover(runtime_dir)) == 2, 120, "two ranks serving")
        # NaN from step 3: by the time the dump attaches, it lies in the ranks' histories.
        dump = run_cli("dump", "--job", "jobN", "--last", "5", "--count", "5", runtime=runtime_dir)
    assert dump.returncode == 0, dump.stderr
    evs = events(dump.stdout)
    found = [e for e in evs if e["type"] == "job_alert"]
    assert found, [e["type"] for e in evs][-20:]
    # (A straggler finding may be there too: after its NaN rank 1 takes a forced pass every
    # step and can truly lag rank 0 by the time the dump attaches.)
    first = next((e for e in found if e["kind"] == "nonfinite_ranks"), found[0])
    assert (first["job"], first["kind"], first["ranks"]) == ("jobN", "nonfinite_ranks", [1])
    assert first["severity"] in ("warning", "error") and not first["cleared"]
    assert first["history"] is True  # judged on what the ranks replayed, not live
    assert "rank 1 only" in first["message"]
    # The ranks' own events still say whose they are; a job alert names its ranks instead.
    assert all("rank" in e for e in evs if e["type"] not in ("job_alert", "slowest_over_time"))
    # The same finding the screen's model judges from the ranks' own dumps, not a second rule.
    assert not [e for e in evs if e["type"] == "job_alert" and e["ranks"] == [0]]


@pytest.mark.slow
def test_follow_prints_no_finding_the_ranks_histories_held(runtime_dir: Path) -> None:
    with ExitStack() as stack:
        stack.enter_context(pretend_rank(runtime_dir, "jobF", 0, 2))
        stack.enter_context(pretend_rank(runtime_dir, "jobF", 1, 2, nan_at=0))
        wait_until(lambda: len(discover(runtime_dir)) == 2, 120, "two ranks serving")
        whole = run_cli("dump", "--job", "jobF", "--last", "3", "--count", "3", runtime=runtime_dir)
        follow = run_cli("dump", "--job", "jobF", "--follow", "--count", "3", runtime=runtime_dir)
    assert whole.returncode == 0 and follow.returncode == 0, whole.stderr + follow.stderr
    # With the history printed, the finding held there is printed (marked as history when it
    # was judged before every rank was live); --follow prints live news only: no old finding.
    assert [e["kind"] for e in events(whole.stdout) if e["type"] == "job_alert"]
    assert not [e for e in events(follow.stdout) if e["type"] == "job_alert"]


@pytest.mark.slow
def test_a_finding_that_arises_while_following_is_printed_live(runtime_dir: Path) -> None:
    # Rank 1's loss turns NaN at step 1500 (seconds after the dump attached): live news.
    with ExitStack() as stack:
        stack.enter_context(pretend_rank(runtime_dir, "jobL", 0, 2))
        stack.enter_context(pretend_rank(runtime_dir, "jobL", 1, 2, nan_at=1500))
        wait_until(lambda: len(discover(runtime_dir)) == 2, 120, "two ranks serving")
        env = dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir))
        dump = subprocess.Popen(
            [*TDBG, "dump", "--job", "jobL", "--follow"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        stack.callback(dump.kill)
        lines: queue.Queue[str] = queue.Queue()

        def read_lines() -> None:
            for line in dump.stdout or ():
                lines.put(line)

        reader = threading.Thread(target=read_lines)
        reader.daemon = True
        reader.start()
        seen: list[dict[str, Any]] = []

        # Other findings may come first: on a loaded machine one of the two identical ranks can
        # truly lag the other for a while (a straggler), which is not what this test is about.
        def alerted() -> bool:
            while not lines.empty():
                seen.append(json.loads(lines.get()))
            return any(e["type"] == "job_alert" and e["kind"] == "nonfinite_ranks" for e in seen)

        wait_until(alerted, 120, "a nonfinite_ranks job_alert event")
    found = next(e for e in seen if e["type"] == "job_alert" and e["kind"] == "nonfinite_ranks")
    assert found["ranks"] == [1]
    assert "history" not in found
    steps = [e["step"] for e in seen if e["type"] == "step" and e.get("rank") == 1]
    assert steps and min(steps) < 1500  # the dump was there before the NaN
