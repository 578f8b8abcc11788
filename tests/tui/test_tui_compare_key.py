"""`b` on a live run's screen: a picker of the recordings nearby (or a path typed in) draws the
chosen one under the loss as `--compare` does; `b` again offers to clear it; a file that is no
recording is one line, and the monitor goes on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Loop
from test_tui_deep import FeedSource
from textual.widgets import Input, OptionList
from waiting import wait_for

import tdbg
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.screens.compare_picker import ClearCompareScreen, ComparePickerScreen
from tdbg.tui.screens.help import KEYS
from tdbg.tui.widgets.loss_chart import LossChart


def _record(path: Path) -> None:
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, serve=False, record=path, name="yesterday")
    loop.run(60, probe)
    probe.close()


async def _footer(pilot: Any, app: TdbgApp) -> str:
    """The key bar: the screen's last line, once it is drawn."""
    await wait_for(pilot, lambda: "Compare" in screen_text(app).splitlines()[-1], "the key bar")
    return screen_text(app).splitlines()[-1]


def _told(app: TdbgApp, text: str) -> Callable[[], bool]:
    return lambda: any(text in notice for notice in app.notices)


def _fitted(app: TdbgApp) -> int:
    data = app.query_one(LossChart)._data
    return -1 if data is None else len(data.fitted)


async def test_b_picks_a_recording_draws_it_and_b_again_clears_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _record(tmp_path / "yesterday.tdbg")
    (tmp_path / "junk.tdbg").write_bytes(b"not a recording")
    source = FeedSource()
    app = make_app(source)
    # 200 columns: the key bar is full at 120 (`r Switch run` is cut there already).
    async with app.run_test(size=(200, 50)) as pilot:
        source.feed(
            pack_steps([StepRecord(step=i, time=1.0 + i, loss=2.0) for i in range(30)], 0),
            {"type": "synced"},
        )
        await wait_for(pilot, lambda: _fitted(app) == 0, "today's steps drawn, alone")
        footer = await _footer(pilot, app)
        assert " b Compare " in footer and footer.index(" r Switch run ") < footer.index(" b ")

        await pilot.press("b")
        await wait_for(pilot, lambda: isinstance(app.screen, ComparePickerScreen), "the picker")
        picker = app.screen
        assert isinstance(picker, ComparePickerScreen)
        names = [p.name for p in picker.files]
        assert sorted(names) == ["junk.tdbg", "yesterday.tdbg"], names
        assert "yesterday.tdbg" in screen_text(app)
        picker.query_one(OptionList).highlighted = names.index("yesterday.tdbg")
        await pilot.press("enter")
        await wait_for(pilot, lambda: _fitted(app) == 1, "yesterday drawn under today")
        await wait_for(pilot, lambda: "━ yesterday.tdbg" in screen_text(app), "in the legend")
        assert app.baselines[0][1].n_steps == 60

        await pilot.press("b")  # again: the offer to clear, kept with n
        await wait_for(pilot, lambda: isinstance(app.screen, ClearCompareScreen), "the offer")
        assert "Comparing with yesterday.tdbg" in screen_text(app)
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ClearCompareScreen), "kept")
        assert len(app.baselines) == 1
        await pilot.press("b")
        await wait_for(pilot, lambda: isinstance(app.screen, ClearCompareScreen), "the offer")
        await pilot.press("y")
        await wait_for(pilot, lambda: _fitted(app) == 0, "the comparison cleared")
        assert "━ yesterday.tdbg" not in screen_text(app)

        # A path typed in that is no recording, then one that is not there: a line each.
        for typed in (tmp_path / "junk.tdbg", tmp_path / "gone.tdbg"):
            await pilot.press("b")
            await wait_for(pilot, lambda: isinstance(app.screen, ComparePickerScreen), "picker")
            field = app.screen.query_one(Input)
            field.focus()
            field.value = str(typed)
            await pilot.press("enter")
            await wait_for(pilot, _told(app, str(typed)), f"{typed.name}: said why")
        said = [n for n in app.notices if "junk.tdbg" in n or "gone.tdbg" in n]
        assert len(said) == 2 and all("\n" not in n for n in said), said
        assert not app.baselines and app.is_running
    assert "b            compare" in KEYS


async def test_the_picker_says_where_it_looked_when_there_is_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TDBG_RECORD", raising=False)
    app = make_app(FeedSource())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("b")
        await wait_for(pilot, lambda: isinstance(app.screen, ComparePickerScreen), "the picker")
        await wait_for(pilot, lambda: "no .tdbg recordings in" in screen_text(app), "said so")
        assert app.screen.query_one(Input).has_focus  # straight to typing a path
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ComparePickerScreen), "closed")
    assert not app.baselines
