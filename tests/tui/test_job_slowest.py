"""The job screen's "Slowest rank over time" panel under its Pilot, fed synthetic rank streams
batch by batch: a rank that comes and goes is named intermittent with its spells and phase; a
job whose slowest rank is noise names nobody."""

from __future__ import annotations

from typing import Any

from straggler_streams import intermittent, noise, record
from test_job_bell import FeedJobSource
from waiting import wait_for

from tdbg.protocol.steps import pack_steps
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp

RANKS = 4


def hello(rank: int) -> dict[str, Any]:
    run = {"name": "ddp", "rank": rank, "world_size": RANKS, "job": "feedjob"}
    return {"type": "hello", "run": run, "rank": rank}


def feed(source: FeedJobSource, steps: range, data: Any) -> None:
    for first in range(steps.start, steps.stop, 20):
        for rank in range(RANKS):
            records = [record(s, data(rank, s)) for s in range(first, first + 20)]
            source.feed(rank, pack_steps(records, 0))


def panel(app: JobApp) -> str:
    """The panel's lines as the screen shows them, joined (a long line wraps at 120)."""
    lines = screen_text(app).splitlines()
    top = next(i for i, line in enumerate(lines) if "Slowest rank over time" in line)
    bottom = next(i for i in range(top + 1, len(lines)) if lines[i].lstrip().startswith("╰"))
    return " ".join(line.strip("│ ") for line in lines[top + 1 : bottom])


async def shown(app: JobApp, pilot: Any, *words: str) -> str:
    def there() -> str | None:
        text = panel(app)
        return text if all(w in text for w in words) else None

    return await wait_for(pilot, there, f"{words} in the slowest-rank panel")


async def test_a_rank_that_comes_and_goes_is_named_intermittent_on_the_job_screen() -> None:
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        for rank in range(RANKS):
            source.feed(rank, hello(rank))
        await shown(app, pilot, "judged once 100 steps are in")
        feed(source, range(700), intermittent(3, 150, 60))
        # The batches fold a tick at a time: a judgement over the first of them can name rank 3
        # already, over fewer steps and spells. Wait for the record over the last 500 steps.
        named = ("rank 3 (intermittent): the slowest in ", "% of the last 500 steps, in ")
        await shown(app, pilot, *named, " spells, the longest ", "input wait")
        subtitle = str(app.screen.query_one("#job-slowest").border_subtitle)
        assert subtitle.startswith("judged every 10 steps since step ")


async def test_noise_names_no_rank_on_the_job_screen() -> None:
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        for rank in range(RANKS):
            source.feed(rank, hello(rank))
        feed(source, range(300), noise(7))
        await shown(app, pilot, "no rank repeatedly the slowest in the last 300 steps")
