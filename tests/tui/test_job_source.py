"""JobSource against real probes: it follows only the ranks of its job (two jobs on one machine
are never mixed), `tdbg-tui` alone opens no job screen when the runs are not one job, and a rank
that dies shows as ended on the job screen while the other goes on."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from pathlib import Path

import pytest
from jobs import pretend_rank
from waiting import wait_for, wait_until

from tdbg.connect.jobs import local_job
from tdbg.connect.runtime import discover
from tdbg.model.job_table import rank_rows
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.sources.job import JobSource


@pytest.mark.slow
async def test_two_jobs_are_never_mixed_and_a_dead_rank_shows_as_ended(runtime_dir: Path) -> None:
    with ExitStack() as stack:
        stack.enter_context(pretend_rank(runtime_dir, "jobA", 0, 2))
        victim = stack.enter_context(pretend_rank(runtime_dir, "jobA", 1, 2))
        stack.enter_context(pretend_rank(runtime_dir, "jobB", 0, 2))
        wait_until(lambda: len(discover(runtime_dir)) == 3, 120, "three probes serving")
        assert local_job(runtime_dir) is None  # two jobs here: tdbg-tui alone shows the picker
        app = JobApp(JobSource("jobA", directory=runtime_dir))
        async with app.run_test(size=(160, 40)) as pilot:

            def both_stepping() -> bool:
                ranks = app.job.ranks
                return set(ranks) == {0, 1} and all(s.n_steps > 5 for s in ranks.values())

            await wait_for(pilot, both_stepping, "both ranks of jobA stepping", 60)
            assert {s.run["job"] for s in app.job.ranks.values()} == {"jobA"}
            os.killpg(victim.pid, signal.SIGKILL)
            await wait_for(pilot, lambda: app.job.ranks[1].ended, "rank 1 ended", 60)
            step = app.job.ranks[0].last_step or 0
            await wait_for(
                pilot, lambda: (app.job.ranks[0].last_step or 0) > step + 5, "rank 0 goes on", 60
            )
            rows = rank_rows(app.job, app.alerts)
            assert [r.rank for r in rows] == [1, 0]  # the dead rank first
            # Its exit status, read before its parent (this test) reaps it.
            assert rows[0].state == "dead: killed by SIGKILL" and rows[1].state == "live"
            await wait_for(
                pilot, lambda: "dead: killed by SIGKILL" in screen_text(app), "the dead on screen"
            )
            assert set(app.job.ranks) == {0, 1}  # jobB's rank 0 never joined
