"""What a source tells the app is a typed message (one class per fact, nested in its source base),
and each app handles each by its type; a message from a source switched away from is dropped."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from textual.message import Message
from waiting import wait_for, wait_until

from tdbg.connect.runtime import waiting_pids
from tdbg.tui.app import make_app
from tdbg.tui.sources.base import DiscoverySource, ReplaySource, Source
from tdbg.tui.sources.job import JobSource
from tdbg.tui.sources.synthetic import RUN, synthetic_run


def _first_said(source: Source | JobSource) -> Message:
    """Open ``source`` on a thread until it says something; that message (then stop it)."""
    said: list[Message] = []
    opened = threading.Thread(target=lambda: _open(source, said), daemon=True)
    opened.start()
    try:
        return wait_until(lambda: said[0] if said else None, what="the source's first word")
    finally:
        source.stop()
        opened.join(10)


def _open(source: Source | JobSource, said: list[Message]) -> None:
    try:
        source.open(said.append)
    except Exception:  # ConnectError once stopped: what it said is what the test reads
        pass


def test_discovery_says_it_waits_with_a_message_of_its_own(runtime_dir: Path) -> None:
    said = _first_said(DiscoverySource(runtime_dir))
    assert isinstance(said, Source.WaitStarted)
    assert said.where == str(runtime_dir)
    assert said.handler_name == "on_source_wait_started"


def test_discovery_is_noted_as_waiting_until_it_stops(runtime_dir: Path) -> None:
    """While tdbg-tui waits for a run, its note holds a run that ends meanwhile (the probe
    serves on until it attached: tests/e2e/test_short_runs.py shows it with tdbg dump)."""
    source = DiscoverySource(runtime_dir)
    opened = threading.Thread(target=lambda: _open(source, []), daemon=True)
    opened.start()
    try:
        wait_until(lambda: os.getpid() in waiting_pids(runtime_dir), what="the waiting note")
    finally:
        source.stop()
        opened.join(10)
    assert os.getpid() not in waiting_pids(runtime_dir)


def test_a_job_source_says_it_waits_with_a_message_of_its_own(runtime_dir: Path) -> None:
    said = _first_said(JobSource("job-nobody-started", runtime_dir))
    assert isinstance(said, JobSource.WaitStarted)
    assert said.what == "a rank of job job-nobody-started"
    assert said.handler_name == "on_job_source_wait_started"


async def test_the_app_handles_each_message_by_type_and_drops_a_stale_one() -> None:
    source = ReplaySource(synthetic_run(steps=5), dict(RUN), end=False)
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        stale = Source.WarningRaised("from the run switched away from")
        stale.origin = ReplaySource([], dict(RUN))
        app.post_message(stale)
        fresh = Source.WarningRaised("the node did not answer")
        fresh.origin = source
        app.post_message(fresh)
        await wait_for(pilot, lambda: "the node did not answer" in app.notices, "the warning")
        assert "from the run switched away from" not in app.notices
        reconnecting = Source.ReconnectStarted("run demo (pid 1)")
        reconnecting.origin = source
        app.post_message(reconnecting)
        await wait_for(pilot, lambda: app.state.connection == "reconnecting", "reconnecting shown")
