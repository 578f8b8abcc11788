"""The job screen under its Pilot, fed by a real 2-rank torchrun job (gloo, CPU) under `tdbg run`:
the rank table, a straggler named live, Enter on a rank and Esc back."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import pretend_rank
from processes import torchrun_job
from waiting import wait_for, wait_until

from tdbg.cli.launch import app_for
from tdbg.connect.jobs import local_job
from tdbg.connect.runtime import discover
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.screens.job import JobScreen, RankScreen
from tdbg.tui.screens.job_profile import JobProfileScreen
from tdbg.tui.sources.job import JobSource
from tdbg.tui.widgets.rank_table import RankTable


@pytest.mark.slow
async def test_the_job_screen_shows_every_rank_and_names_a_straggler(runtime_dir: Path) -> None:
    with torchrun_job(2, "--grad-every", "1", DDP_STEPS="100000", DDP_SLOW_RANK="1"):
        app = JobApp(JobSource(directory=runtime_dir))
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_for(pilot, lambda: len(app.job.ranks) == 2, "both ranks attached", 120)
            # `tdbg-tui` alone opens this screen: every local run is a rank of this one job.
            assert local_job(runtime_dir) == app.job.job != ""
            table = app.screen.query_one(RankTable)

            shown = (
                "straggler: rank 1 holds the others up",
                "of 2 ranks",
                "input wait",
                "applies: every rank watches the same",
            )

            def straggler_on_screen() -> str | None:
                text = screen_text(app)
                return text if all(s in text for s in shown) else None

            # One frame with all of it: the verdict and the panels beside it repaint apart.
            await wait_for(pilot, straggler_on_screen, "a straggler named on screen", 120)

            def flagged() -> bool:
                return table.row_count == 2 and str(table.get_row_at(0)[-1]) == "straggler"

            # The rank table: both ranks, the straggler first (worst first), flagged.
            await wait_for(pilot, flagged, "the straggler flagged in the rank table")
            first = [str(c) for c in table.get_row_at(0)]
            second = [str(c) for c in table.get_row_at(1)]
            assert first[0] == "1" and first[-1] == "straggler"
            assert second[0] == "0" and second[-1] == "ok"
            # Enter on the straggler opens its own full screen; Esc comes back to the job.
            table.move_cursor(row=0)
            table.focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, RankScreen), "rank 1's screen")
            assert isinstance(app.screen, RankScreen) and app.screen.rank == 1
            await wait_for(
                pilot, lambda: "Gradient norms per layer" in screen_text(app), "the rank's panels"
            )
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, JobScreen), "back to the job")


@pytest.mark.slow
async def test_a_rank_that_raises_shows_as_dead_with_its_exit(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 of a 2-rank torchrun job raises once both ranks are on screen: its probe's
    goodbye says how it ended (Python exits 1 on an uncaught error), and its row says so."""
    trigger = tmp_path / "fail-now"
    with torchrun_job(2, DDP_STEPS="100000", DDP_RAISE_RANK="1", DDP_RAISE_WHEN=str(trigger)):
        app = JobApp(JobSource(directory=runtime_dir))
        async with app.run_test(size=(180, 40)) as pilot:
            await wait_for(pilot, lambda: len(app.job.ranks) == 2, "both ranks attached", 120)
            trigger.touch()

            def rank_1_ended() -> str | None:
                state = app.job.ranks.get(1)
                return state.end_reason if state is not None and state.ended else None

            reason = await wait_for(pilot, rank_1_ended, "rank 1 ended", 120)
            assert reason == "exit 1: RuntimeError: rank 1 fails on purpose"
            words = "dead: exit 1: RuntimeError: rank 1 fails on purpose"
            await wait_for(pilot, lambda: words in screen_text(app), "rank 1 dead on screen")
            table = app.screen.query_one(RankTable)
            assert str(table.get_row("1")[-1]) == words  # in its own row's last column


@pytest.mark.slow
async def test_p_profiles_every_rank_and_puts_the_slowest_beside_the_fastest(
    runtime_dir: Path,
) -> None:
    """`p` on the job screen of a 2-rank torchrun job whose rank 1 reads its batches slowly:
    both ranks profile the same steps, and the screen (at 80x24) names rank 1 the slowest and
    rank 0 the fastest, their ops side by side; Esc closes it."""
    with torchrun_job(2, "--grad-every", "1", DDP_STEPS="100000", DDP_SLOW_RANK="1"):
        app = JobApp(JobSource(directory=runtime_dir))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: len(app.job.ranks) == 2, "both ranks attached", 120)
            await pilot.press("p")
            await wait_for(pilot, lambda: isinstance(app.screen, JobProfileScreen), "the panel")
            profile = app.job_profile
            assert profile is not None and sorted(profile.sent) == [0, 1] and not profile.unsent

            shown = ("profiling 2 ranks: 2 done", "slowest rank 1:", "fastest rank 0:", "aten::")

            def compared() -> str | None:
                text = screen_text(app)
                return text if all(s in text for s in shown) else None

            # One frame with all of it (the table lays out a frame after the lines above it).
            text = await wait_for(pilot, compared, "the ranks compared on screen", 180)
            assert "in collectives" in text and "difference" in text, text
            answers = profile.answers(app.job)
            comparison = profile.comparison(answers)
            assert comparison is not None
            assert (comparison.slowest.rank, comparison.fastest.rank) == (1, 0)
            both = [op for op in comparison.ops if op.slow_us is not None and op.fast_us]
            assert any(op.name.startswith("aten::") for op in both), comparison.ops
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, JobScreen), "back to the job")


@pytest.mark.slow
async def test_tdbg_tui_given_the_name_the_ranks_share_shows_the_job(runtime_dir: Path) -> None:
    """``tdbg-tui NAME``, NAME shared by one job's ranks (torchrun names them all after the
    script): the job screen, as ``tdbg-tui --job JOB``, not "2 runs named NAME"."""
    with (
        pretend_rank(runtime_dir, "jobA", 0, 2, name="train"),
        pretend_rank(runtime_dir, "jobA", 1, 2, name="train"),
    ):
        wait_until(lambda: len(discover(runtime_dir)) == 2, 120, "both ranks serving")
        app, source = app_for("train")
        assert isinstance(app, JobApp) and source is not None
        try:
            async with app.run_test(size=(160, 40)) as pilot:
                await wait_for(pilot, lambda: sorted(app.job.ranks) == [0, 1], "both ranks", 60)
                assert app.job.job == "jobA"
        finally:
            source.close()
