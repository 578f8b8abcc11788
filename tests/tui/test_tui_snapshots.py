"""Snapshots of the real app on the synthetic run: live, stalled, non-finite, ended, a profile
shown, the heatmap and a validation pass just done, each at 80x24, 120x40 and 200x60 (issue 11).

Each snapshot is the screen as an SVG (colours and all, what ``app.export_screenshot()`` gives;
open it in a browser) and as plain text beside it (what a review diff reads), under
``tests/tui/snapshots/``. The clock the app reads is frozen and the data is synthetic, so a run
gives the same screen every time. pytest-textual-snapshot is the Textual convention, but it
pins syrupy 4.8, which needs pytest < 9; this file does the same with nothing extra.

When the screen changes on purpose, regenerate every snapshot with one command, then look at
what changed (``git diff --stat tests/tui/snapshots``, the SVGs in a browser) before committing:

    TDBG_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest -q tests/tui/test_tui_snapshots.py
"""

from __future__ import annotations

import difflib
import os
import time
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from waiting import wait_for

from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import (
    RUN,
    START_TIME,
    job_messages,
    profile_result,
    synthetic_run,
)

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("TDBG_UPDATE_SNAPSHOTS") == "1"
SIZES = ((80, 24), (120, 40), (200, 60))
STEPS = 400
NOW = START_TIME + STEPS * 0.05 + 0.5  # the frozen wall clock: just after the last step
PROFILE_ARGS = {
    "steps": 5,
    "max_seconds": 30.0,
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
}


class FrozenTime:
    """The ``time`` module as the app's state sees it: wall-clock ``time()`` is ``now``,
    which a test moves; everything else is the real module's."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FrozenTime:
    frozen = FrozenTime(NOW)
    # Only the app's own readings of the wall clock (elapsed, when steps arrived, the verdict);
    # Textual's timers keep the real monotonic clock.
    monkeypatch.setattr("tdbg.model.run_state._time", frozen)
    monkeypatch.setattr("tdbg.model.health.time", frozen)
    return frozen


def source_for(state: str) -> ReplaySource:
    messages = synthetic_run(
        steps=STEPS,
        nan_at=STEPS - 20 if state == "nonfinite" else None,
        eval_every=STEPS - 10 if state == "evaluated" else None,
    )
    if state == "profile":
        messages += job_messages(1, "profile", PROFILE_ARGS, profile_result((300, 304)), start=300)
    return ReplaySource(messages, dict(RUN), end=state == "ended")


async def settled(pilot: Pilot[Any], app: TdbgApp) -> str:
    """Repaint everything until a repaint no longer changes the screen; its text.

    A paint can change the layout (a table's scrollbar comes or goes) and the widths a panel
    picks follow the layout it was painted into, so one or two repaints can catch the layout
    mid-change (seen on a quiet machine): repaint to a fixpoint instead."""
    app.clear_notifications()
    previous = None
    for _ in range(6):
        app.monitor.repaint(force=True)
        await wait_for(pilot, lambda: app.painted_revision == app.state.revision, "painted")
        await pilot.pause()
        text = await _stable(pilot, app)
        if text == previous:
            return text
        previous = text
    assert previous is not None
    return previous


async def _stable(pilot: Pilot[Any], app: TdbgApp) -> str:
    """Wait until two reads of the screen in a row agree; its text."""
    last = [""]

    def same_twice() -> bool:
        text = screen_text(app)
        same = text == last[0] and text.startswith(" tdbg")
        last[0] = text
        return same

    await wait_for(pilot, same_twice, "the screen settled")
    return last[0]


def check(app: TdbgApp, text: str, name: str) -> None:
    """Compare with (or, updating, write) ``tests/tui/snapshots/NAME.svg`` and ``NAME.txt``."""
    svg = app.export_screenshot(title=name, simplify=True)
    svg_path, txt_path = SNAPSHOTS / f"{name}.svg", SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        svg_path.write_text(svg, encoding="utf-8")
        txt_path.write_text(text, encoding="utf-8")
        return
    if not txt_path.exists():
        pytest.fail(f"no snapshot {txt_path.name}: run with TDBG_UPDATE_SNAPSHOTS=1 (docstring)")
    want = txt_path.read_text(encoding="utf-8")
    if text != want:
        diff = difflib.unified_diff(
            want.splitlines(), text.splitlines(), "snapshot", "now", lineterm=""
        )
        pytest.fail(f"{name} differs from its snapshot:\n" + "\n".join(diff))
    assert svg == svg_path.read_text(encoding="utf-8"), f"{name}: same text, other colours"


async def shoot(state: str, clock: FrozenTime, keys: tuple[str, ...] = ()) -> None:
    app = make_app(source_for(state))
    w, h = SIZES[0]
    async with app.run_test(size=(w, h)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == STEPS and app.state.synced, "data")
        if state == "ended":
            await wait_for(pilot, lambda: app.state.connection == "ended", "the end")
        if state == "profile":
            await wait_for(pilot, lambda: app.state.deep.profile is not None, "the profile")
        if state == "stalled":
            clock.now = NOW + 63  # no step since: the header's own clock says stalled
            header = app.query_one("RunHeader")
            await wait_for(pilot, lambda: header.has_class("-stalled"), "stalled")
        for key in keys:
            await pilot.press(key)
        for w, h in SIZES:
            await pilot.resize_terminal(w, h)
            await wait_for(pilot, lambda: app.size == (w, h), f"{w}x{h}")  # noqa: B023
            text = await settled(pilot, app)
            check(app, text, f"{state}-{w}x{h}")


async def test_live(clock: FrozenTime) -> None:
    await shoot("live", clock)


async def test_stalled(clock: FrozenTime) -> None:
    await shoot("stalled", clock)


async def test_nonfinite(clock: FrozenTime) -> None:
    await shoot("nonfinite", clock)


async def test_ended(clock: FrozenTime) -> None:
    await shoot("ended", clock)


async def test_profile_shown(clock: FrozenTime) -> None:
    await shoot("profile", clock)


async def test_evaluated(clock: FrozenTime) -> None:
    """A validation pass ten steps ago: the anatomy bar names its no-grad share (at 80x24 in
    short names, so the last phase still shows), and the run is not input-bound."""
    await shoot("evaluated", clock)


async def test_heatmap(clock: FrozenTime) -> None:
    await shoot("heatmap", clock, keys=("h",))
