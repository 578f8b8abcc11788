"""The real Textual app under its Pilot, fed by a real probe in a demo training subprocess."""

from __future__ import annotations

from pathlib import Path

from demo_job import demo_job
from textual.widgets import ContentSwitcher
from waiting import wait_for

from tdbg.tui.app import make_app, screen_text
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import SocketSource


async def test_panels_show_live_run(runtime_dir: Path) -> None:
    args = ("--delay", "0.002", "--nan-at", "150", "--layer", "body.1", "--steps", "100000")
    with demo_job("nan", *args, runtime=runtime_dir) as (proc, entry):
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=(160, 48)) as pilot:
            state = app.state
            await wait_for(
                pilot, lambda: state.connection == "live" and len(state.steps) > 20, what="steps"
            )
            # One wait for all: a frame read as soon as the layer names show may be a panel behind.
            panels = ("head", f"pid {proc.pid}", "Loss", "Gradient norms", "Memory")
            await wait_for(
                pilot, lambda: all(p in screen_text(app) for p in panels), what=f"{panels}"
            )
            # No GPU here: once the first system sample arrives the memory panel says so in one
            # dim line, not in orange n/a lines.
            await wait_for(pilot, lambda: "no GPU" in screen_text(app), what="the CPU-run line")
            assert "n/a: GPU" not in screen_text(app)
            await wait_for(pilot, lambda: state.nonfinite_alerts > 0, what="a non-finite alert")
            await wait_for(
                pilot,
                lambda: "body.1" in screen_text(app) and "non-finite" in screen_text(app),
                what="the alert naming body.1 on screen",
            )
            switcher = app.query_one("#grad-switcher", ContentSwitcher)
            await pilot.press("h")
            await wait_for(pilot, lambda: switcher.current == "grad-heatmap", "the heatmap")
            await pilot.press("l")
            monitor = app.screen
            assert isinstance(monitor, MonitorScreen) and monitor.log_scale
            await wait_for(pilot, lambda: "log (l)" in screen_text(app), "log scale on screen")
        proc.terminate()


async def test_run_end_keeps_data(runtime_dir: Path) -> None:
    # The run ends once the TUI has it live (a fixed step count may end before a slow start).
    with demo_job("mlp", "--delay", "0.002", "--steps", "100000", runtime=runtime_dir) as (
        proc,
        e,
    ):
        app = make_app(SocketSource(path=str(e.socket)))
        async with app.run_test(size=(160, 48)) as pilot:
            state = app.state
            await wait_for(pilot, lambda: state.n_steps > 20, what="live steps")
            proc.terminate()  # the demo closes its probe and exits 0
            await wait_for(pilot, lambda: state.connection == "ended", what="run end")
            last = state.last_step
            assert last is not None and len(state.steps) == last + 1  # none lost or doubled
            assert list(state.steps.values) == list(range(last + 1))
            await wait_for(
                pilot,
                lambda: "run ended" in screen_text(app) and f"step {last}" in screen_text(app),
                what=f"'run ended' at step {last} on screen",
            )
