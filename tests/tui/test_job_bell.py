"""The job screen's bell: the first finding of each kind rings once (NaN on some ranks, a rank
that died), none judged while a rank still replays its history, off with TDBG_BELL=0 and in a
replayed job."""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from waiting import wait_for

from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.job_app import JobApp
from tdbg.tui.sources.base import Notify
from tdbg.tui.sources.job import JobSource, RankBatches


class FeedJobSource(JobSource):
    """A job's ranks as the test feeds them, batch by batch."""

    def __init__(self) -> None:
        super().__init__("feedjob")
        self.inbox: queue.SimpleQueue[RankBatches] = queue.SimpleQueue()

    def feed(self, rank: int, *messages: dict[str, Any]) -> None:
        self.inbox.put({rank: list(messages)})

    def open(self, notify: Notify) -> None:
        pass

    def batches(self) -> Iterator[RankBatches]:
        while not self.stopped:
            try:
                yield self.inbox.get(timeout=0.05)
            except queue.Empty:
                continue


def hello(rank: int) -> dict[str, Any]:
    return {"type": "hello", "run": {"name": "ddp", "rank": rank, "job": "feedjob"}, "rank": rank}


def steps(first: int, n: int, loss: float) -> dict[str, Any]:
    records = [StepRecord(step=i, time=1.0 + i, loss=loss) for i in range(first, first + n)]
    return pack_steps(records, 0)


async def _nan_then_death(source: FeedJobSource, app: JobApp, pilot: Any, synced: bool) -> None:
    for rank in (0, 1):
        source.feed(rank, hello(rank), steps(0, 10, 1.0), *([{"type": "synced"}] * synced))
    await wait_for(pilot, lambda: len(app.job.ranks) == 2, "both ranks folded")
    source.feed(1, steps(10, 5, math.nan))  # rank 1 alone goes NaN: a finding
    await wait_for(pilot, lambda: "nonfinite_ranks" in str(app.alerts.active), "NaN on rank 1")
    source.feed(1, steps(15, 5, math.nan))  # the same finding goes on: no second ring
    source.feed(0, {"type": "bye", "reason": "exit 1: RuntimeError"})  # rank 0 dies
    await wait_for(pilot, lambda: app.job.ranks[0].ended, "rank 0 ended")
    await wait_for(pilot, lambda: 0 in app.ringer.dead or not app.ringer.enabled, "judged")


async def test_each_finding_kind_rings_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDBG_BELL", raising=False)
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await _nan_then_death(source, app, pilot, synced=True)
        await wait_for(pilot, lambda: len(app.rings) == 2, "both rung")
        source.feed(1, {"type": "bye", "reason": "exit 1: RuntimeError"})  # a second death
        await wait_for(pilot, lambda: 1 in app.ringer.dead, "rank 1's death judged")
        await pilot.pause()
    assert app.rings == ["nonfinite_ranks", "dead_rank"]


async def test_history_and_tdbg_bell_0_never_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDBG_BELL", raising=False)
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        # The ranks are still replaying their history (no `synced`): the finding is old news.
        source.feed(0, hello(0), steps(0, 10, 1.0))
        source.feed(1, hello(1), steps(0, 10, 1.0), steps(10, 5, math.nan))
        await wait_for(pilot, lambda: "nonfinite_ranks" in str(app.alerts.active), "found")
        await pilot.pause()
    assert app.rings == []

    monkeypatch.setenv("TDBG_BELL", "0")
    source = FeedJobSource()
    app = JobApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await _nan_then_death(source, app, pilot, synced=True)
        await pilot.pause()
    assert not app.ringer.enabled and app.rings == []
