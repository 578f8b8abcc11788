"""Settings that persist (issue 34): chosen in one session, back in the next; a corrupt or
unreadable file is a one-line warning and the defaults; the colour-blind palette."""

from __future__ import annotations

import json
from pathlib import Path

from test_tui_loss_chart import focus_by_tab
from waiting import wait_for

from tdbg.tui.app import TdbgApp, make_app
from tdbg.tui.colours import SUFFIX, meaning
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.settings import Settings, load_settings, save_settings, settings_path
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.gradient_table import GradientTable
from tdbg.tui.widgets.loss_chart import LossChart


def new_app() -> TdbgApp:
    return make_app(ReplaySource(synthetic_run(steps=400), dict(RUN)))


def test_the_file_lives_in_the_xdg_config_directory(_private_settings: Path) -> None:
    assert settings_path() == _private_settings / "tdbg" / "settings.json"


def test_save_is_whole_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "settings.json"
    save_settings(Settings(palette="colour-blind", log_y=["loss"]), path)
    assert [p.name for p in path.parent.iterdir()] == ["settings.json"]  # no temporary left
    settings, warning = load_settings(path)
    assert warning is None and settings.palette == "colour-blind" and settings.log_y == ["loss"]


def test_fields_it_gets_wrong_keep_their_defaults(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"heatmap": True, "palette": "pink", "chart_window": -3}))
    settings, warning = load_settings(path)
    assert settings.heatmap and settings.palette == "default" and settings.chart_window is None
    assert warning is not None and "palette, chart_window" in warning


async def test_settings_come_back_in_the_next_session() -> None:
    app = new_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await pilot.press("h", "o", "C")
        chart = app.query_one(LossChart)
        await focus_by_tab(pilot, app, chart)
        await pilot.press("plus", "f", "l")  # half the run: 199 of 0–399
        await wait_for(pilot, lambda: app.settings.log_y == ["loss"], "the log scale kept")
        app.theme = "nord"
        await wait_for(pilot, lambda: app.settings.theme == "nord", "the theme kept")
    saved = json.loads(settings_path().read_text())
    assert saved["heatmap"] and saved["grad_sort"] == "norm" and saved["palette"] == "colour-blind"
    assert saved["chart_window"] == 199 and saved["full_range"] and saved["log_y"] == ["loss"]
    assert saved["theme"] == "nord"

    again = new_app()
    async with again.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: again.state.n_steps == 400, "400 steps")
        monitor = again.screen
        assert isinstance(monitor, MonitorScreen)
        assert monitor.heatmap and again.query_one(GradientTable).sort_mode == "norm"
        chart = again.query_one(LossChart)
        assert chart.window.size == 199 and chart.full_range and chart.logs == {"loss"}
        assert again.theme == "nord" + SUFFIX  # nord, in the colour-blind palette
        assert meaning(again, "bad").upper() == "#D55E00"
        assert not again.notices


async def test_a_corrupt_file_is_one_warning_and_the_defaults() -> None:
    path = settings_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"heatmap": tru', encoding="utf-8")
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await wait_for(pilot, lambda: app.notices, "the warning")
        assert len(app.notices) == 1 and "settings not read" in app.notices[0]
        assert "\n" not in app.notices[0]
        assert app.settings == Settings()
        await pilot.press("h")  # a choice made now replaces the corrupt file
        await wait_for(pilot, lambda: load_settings(path)[0].heatmap, "a good file again")


async def test_an_unreadable_file_is_one_warning_too() -> None:
    settings_path().mkdir(parents=True)  # a directory where the file should be
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.notices, "the warning")
        assert "settings not read" in app.notices[0]
        await pilot.press("h")  # cannot be written either: said once, the key still works
        await pilot.press("h")
        await wait_for(pilot, lambda: len(app.notices) == 2, "the write's warning")
        assert "settings not saved" in app.notices[1]
