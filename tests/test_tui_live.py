"""The real Textual app under its Pilot, fed by a real probe in a demo training subprocess."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from demo_job import demo_job

from tdbg.tui.app import make_app, screen_text
from tdbg.tui.sources.base import SocketSource


async def until(condition, timeout: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.05)


async def test_panels_show_live_run(runtime_dir: Path) -> None:
    args = ("--delay", "0.002", "--nan-at", "150", "--layer", "body.1", "--steps", "100000")
    with demo_job("nan", *args, runtime=runtime_dir) as (proc, entry):
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=(160, 48)) as pilot:
            state = app.state
            await until(lambda: state.connection == "live" and len(state.steps) > 20, what="steps")
            await until(lambda: "head" in screen_text(app), what="layer names on screen")
            text = screen_text(app)
            assert f"pid {proc.pid}" in text
            assert "Loss" in text and "Gradient norms" in text and "Memory" in text
            # No GPU here: once the first system sample arrives the memory panel says why.
            await until(lambda: "NVML" in screen_text(app), what="missing-GPU reason")
            await until(lambda: state.nonfinite_alerts > 0, what="a non-finite alert")
            await until(
                lambda: "body.1" in screen_text(app) and "non-finite" in screen_text(app),
                what="the alert naming body.1 on screen",
            )
            await pilot.press("h")
            await pilot.pause()
            await pilot.press("l")
            await pilot.pause()
            assert "log" in screen_text(app)
        proc.terminate()


async def test_run_end_keeps_data(runtime_dir: Path) -> None:
    with demo_job("mlp", "--delay", "0.002", "--steps", "120", runtime=runtime_dir) as (proc, e):
        app = make_app(SocketSource(path=str(e.socket)))
        async with app.run_test(size=(160, 48)):
            state = app.state
            await until(lambda: state.connection == "ended", what="run end")
            assert len(state.steps) == 120  # history + live, no step lost or doubled
            assert list(state.steps.values) == list(range(120))
            await until(lambda: "run ended" in screen_text(app), what="'run ended' on screen")
            assert "step 119" in screen_text(app)
