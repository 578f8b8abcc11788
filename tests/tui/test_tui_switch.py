"""`r` switches runs inside the TUI; the picker shows each run's step, loss, age and health."""

from __future__ import annotations

from pathlib import Path

from demo_job import demo_job
from textual.widgets import OptionList
from waiting import wait_for

from tdbg.tui.app import make_app, screen_text
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.screens.picker import RunPickerScreen
from tdbg.tui.sources.base import SocketSource

DEMO = ("--delay", "0.01", "--steps", "100000", "--width", "16", "--depth", "3")


async def test_r_opens_the_picker_with_each_run_s_figures_and_switches(runtime_dir: Path) -> None:
    with (
        demo_job("mlp", *DEMO, "--name", "first", runtime=runtime_dir) as (_, first),
        demo_job("mlp", *DEMO, "--name", "second", runtime=runtime_dir) as (proc, second),
    ):
        app = make_app(SocketSource(path=str(first.socket)))
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_for(pilot, lambda: app.state.n_steps > 10, what="the first run's steps")
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, RunPickerScreen), "the picker")
            screen = app.screen
            assert isinstance(screen, RunPickerScreen)
            picker: RunPickerScreen = screen
            assert {e.name for e in picker.entries} == {"first", "second"}
            await wait_for(pilot, lambda: len(picker.glances) == 2, what="both rows peeked")
            for glance in picker.glances.values():
                assert glance.error is None and glance.step is not None and glance.step > 0
                assert glance.health is not None and glance.health.word == "live"
            # The rows repaint once peeked: wait for the frame that shows them.
            shown = ("← on screen", "● live", " ago", "loss ", "step ")
            await wait_for(pilot, lambda: all(s in screen_text(app) for s in shown), f"{shown}")

            # Escape stays on the run shown.
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the monitor")
            assert app.state.run["name"] == "first"

            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, RunPickerScreen), "the picker")
            screen = app.screen
            assert isinstance(screen, RunPickerScreen)
            picker = screen
            index = [e.name for e in picker.entries].index("second")
            picker.query_one(OptionList).highlighted = index
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the monitor")
            await wait_for(
                pilot,
                lambda: app.state.run.get("pid") == proc.pid and app.state.n_steps > 10,
                what="the second run's steps",
            )
            # Only the second run's steps, each once: the first run's late batches were dropped.
            steps = [int(s) for s in app.state.steps.values]
            assert steps == list(range(steps[0], steps[0] + len(steps))), steps[:50]
            await wait_for(pilot, lambda: "second" in screen_text(app), what="its name on screen")
            assert any("switched to run second" in n for n in app.notices)
