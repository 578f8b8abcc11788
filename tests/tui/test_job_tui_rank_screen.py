"""The job's one rank screen, re-pointed on each Enter (not rebuilt): open rank A, Esc, open rank
B, and B's figures are on screen and none of A's — in a small job read whole, and in a large job
whose rank B's stream has not come yet."""

from __future__ import annotations

from typing import Any

from test_job_bell import FeedJobSource
from test_job_scale import HIGH_LOSS, OFF, PER_NODE, SLOW, SummaryFeed, summaries
from waiting import wait_for

from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.screens.job import RankScreen
from tdbg.tui.screens.job_scale import ScaleJobScreen
from tdbg.tui.widgets.gradient_table import GradientTable
from tdbg.tui.widgets.rank_table import RankTable

# Each rank's own figures: its run's name, its layers, its loss (what the screen prints).
FIGURES = {
    0: ("alpharun", ["alpha_embed", "alpha_head"], 1.234),
    1: ("betarun", ["beta_embed", "beta_head"], 7.654),
}


def stream(rank: int, name: str, layers: list[str], loss: float) -> list[dict[str, Any]]:
    """A rank's hello, its layers and 30 steps at ``loss``, as its probe sends them."""
    records = [
        StepRecord(step, 1.0 + step, loss, step_time=0.1, grad_norms=[0.5] * len(layers))
        for step in range(30)
    ]
    return [
        {"type": "hello", "name": name, "rank": rank, "world_size": 2, "job": "feedjob"},
        {"type": "layers", "names": layers, "numel": [10] * len(layers)},
        pack_steps(records, len(layers)),
    ]


def words(rank: int) -> list[str]:
    name, layers, loss = FIGURES[rank]
    return [name, *layers, f"{loss:.4g}"]


async def open_row(pilot: Any, app: JobApp, rank: int) -> RankScreen:
    table = app.screen.query_one(RankTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(str(rank)))
    await pilot.pause()
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, RankScreen), f"rank {rank}'s screen")
    screen = app.screen
    assert isinstance(screen, RankScreen) and screen.rank == rank
    return screen


async def test_rank_b_after_rank_a_shows_b_only_on_the_same_screen() -> None:
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(160, 40)) as pilot:
        for rank, (name, layers, loss) in FIGURES.items():
            source.feed(rank, *stream(rank, name, layers, loss))
        await wait_for(pilot, lambda: "2 of 2 ranks" in screen_text(app), "both ranks")

        first = await open_row(pilot, app, 0)
        await wait_for(pilot, lambda: all(w in screen_text(app) for w in words(0)), "A's figures")
        await pilot.press("e")  # the inspect cursor on A's chart
        assert first.cursor_step is not None
        first.chart_metric = "acc"  # as enter on A's metric would leave it
        first.action_back()  # back with both still set (Esc would leave the cursor first)
        await wait_for(pilot, lambda: not isinstance(app.screen, RankScreen), "the job again")

        second = await open_row(pilot, app, 1)
        assert second is first  # re-pointed, not rebuilt
        assert second.cursor_step is None and second.chart_metric is None
        assert not second.has_class("-cursor")

        await shows_only(pilot, app, 1, 0)
        shown = [str(row[0]) for row in map(second.query_one(GradientTable).get_row_at, [0, 1])]
        assert all("beta" in cell for cell in shown), shown

        await pilot.press("escape")  # and A again: A's figures, none of B's
        await wait_for(pilot, lambda: not isinstance(app.screen, RankScreen), "the job again")
        assert await open_row(pilot, app, 0) is first
        await shows_only(pilot, app, 0, 1)


async def shows_only(pilot: Any, app: JobApp, rank: int, other: int) -> None:
    """Wait for rank ``rank``'s figures on its screen, then none of rank ``other``'s may be."""

    def shown() -> str | None:
        text = screen_text(app)
        return text if all(w in text for w in words(rank)) else None

    text = await wait_for(pilot, shown, f"rank {rank}'s figures")
    for word in words(other):
        assert word not in text, f"rank {other}'s {word!r} still on rank {rank}'s screen"


async def test_a_large_jobs_rank_b_shows_nothing_of_a_before_its_stream_comes() -> None:
    """In a large job Enter asks the rank's node for its stream: until it comes, the re-pointed
    screen shows rank B with nothing in it, not what rank A's stream had filled in."""
    source = SummaryFeed()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        source.pending = summaries()
        await wait_for(pilot, lambda: "64 of 64 ranks" in screen_text(app), "the first summaries")
        ranks = [int(str(key.value)) for key in app.screen.query_one(RankTable).rows]
        # Two ordinary ranks well down the table, on two nodes: the top row stays on the worst
        # rank as summaries re-sort it (RankTable: a cursor there is not a choice), and which
        # of the slow, diverged and high-loss ranks is worst changes as their findings come.
        calm = [r for r in ranks[len(ranks) // 4 :] if r not in (SLOW, OFF, HIGH_LOSS)]
        a, b = calm[0], next(r for r in calm[1:] if r // PER_NODE != calm[0] // PER_NODE)

        first = await open_row(pilot, app, a)
        name, layers, loss = FIGURES[0]
        source.feed(a, *stream(a, name, layers, loss))
        await wait_for(pilot, lambda: all(w in screen_text(app) for w in words(0)), "A's figures")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ScaleJobScreen), "the job again")
        assert source.given_back == [a]

        second = await open_row(pilot, app, b)
        assert second is first and source.subscribed[-1] == (b, f"node{b // PER_NODE}")
        await wait_for(pilot, lambda: f"rank {b}" in screen_text(app), "B's name in its header")
        text = screen_text(app)
        for word in words(0):
            assert word not in text, f"rank {a}'s {word!r} on rank {b}'s empty screen"
        assert second.query_one(GradientTable).row_count == 0

        name, layers, loss = FIGURES[1]
        source.feed(b, *stream(b, name, layers, loss))
        await wait_for(pilot, lambda: all(w in screen_text(app) for w in words(1)), "B's figures")
