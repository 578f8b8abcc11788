"""The loss chart in the real app: whole-step ticks, the NaN marker, and its keys (window, zoom,
pan, y-range) each making the change they promise on screen."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_tui_app import painted, shows
from textual.pilot import Pilot
from waiting import wait_for

from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.colours import meaning_rgb
from tdbg.tui.screens.help import KEYS
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.loss_chart import LossChart


async def focus_by_tab(pilot: Pilot[Any], app: TdbgApp, widget: Any) -> None:
    """Press tab until ``widget`` has the focus, as a user would reach it."""
    for _ in range(20):
        if app.focused is widget:
            return
        await pilot.press("tab")
    assert app.focused is widget, f"tab never reached {widget!r}; focused: {app.focused!r}"


def chart_lines(app: TdbgApp) -> list[str]:
    """The loss chart's rows as they are on screen."""
    chart = app.query_one(LossChart)
    region = chart.content_region
    rows = screen_text(app).split("\n")[region.y : region.bottom]
    return [row[region.x : region.right] for row in rows]


async def test_step_ticks_are_whole_steps_and_the_nan_is_marked() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=2000, n_layers=4, nan_at=1980), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 2000, "2000 steps")
        await painted(pilot, app)
        await shows(pilot, app, "NaN at step 1980", "steps 0–1999")
        lines = chart_lines(app)
        axis = lines[-1]
        assert "1k" in axis and "1.5k" in axis, axis
        plot = "\n".join(lines)
        assert not re.search(r"\de\d|\de[+-]", plot), plot  # no 1.9e2
        assert not re.search(r"(?<![\d.])-\d", axis), axis  # no negative step
        assert not re.search(r"\d\.\d", axis.replace("1.5k", "")), axis  # no 33.3
        # The vertical NaN line: one column of │ inside the plot.
        assert sum(row.count("│") for row in lines[1:-2]) > 2 * (len(lines) - 4)


async def test_keys_window_zoom_pan_and_range_change_what_is_shown() -> None:
    for key in ("w", "+", "-", ",", ".", "f", "v"):
        assert f"\n{key} " in f"\n{KEYS}" or f" {key} " in KEYS, f"{key} is in the help"
    app = make_app(ReplaySource(synthetic_run(steps=2000, n_layers=4), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 2000, "2000 steps")
        await painted(pilot, app)
        chart = app.query_one(LossChart)
        await focus_by_tab(pilot, app, chart)
        await shows(pilot, app, "all steps 0–1999 · y fitted · keys w + - , . f v")
        await pilot.press("w")
        await shows(pilot, app, "steps 1499–1999 (newest)")
        await pilot.press("plus")
        await shows(pilot, app, "steps 1749–1999 (newest)")
        await pilot.press("comma")
        await shows(pilot, app, "steps 1687–1937 ·")
        await pilot.press("comma")
        await shows(pilot, app, "steps 1625–1875 ·")
        await pilot.press("full_stop")
        await pilot.press("full_stop")
        await shows(pilot, app, "steps 1749–1999 (newest)")
        await pilot.press("minus")
        await shows(pilot, app, "steps 1499–1999 (newest)")
        assert "1.5k" in chart_lines(app)[-1]  # the ticks follow the window
        await pilot.press("minus", "minus")
        await shows(pilot, app, "all steps 0–1999")

        # The fitted range leaves out the first steps' loss; the full range shows it.
        def top_label() -> float:
            return max(
                float(m) for m in re.findall(r"^\s*([\d.]+)┤", "\n".join(chart_lines(app)), re.M)
            )

        fitted = top_label()
        await pilot.press("f")
        await shows(pilot, app, "· y full")
        await wait_for(
            pilot, lambda: top_label() > fitted, "the full range reaches the first steps' loss"
        )
        await pilot.press("f")
        await shows(pilot, app, "· y fitted")
        await pilot.press("w")
        await shows(pilot, app, "steps 1499–1999 (newest)")
        await pilot.press("w")
        await shows(pilot, app, "all steps 0–1999")


async def test_v_shows_the_step_time_of_each_step_and_back() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400, n_layers=4), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await painted(pilot, app)
        chart = app.query_one(LossChart)
        await focus_by_tab(pilot, app, chart)
        await pilot.press("v")
        await shows(pilot, app, "step time ms, now 20 steps/s")  # the synthetic steps: 50 ms
        labels = re.findall(r"^\s*([\d.]+)┤", "\n".join(chart_lines(app)), re.M)
        assert "50" in labels, labels  # the y axis is in ms now
        await pilot.press("v")
        await wait_for(pilot, lambda: "step time ms" not in screen_text(app), "the loss again")


CONVERGED_RUN = """
import asyncio, dataclasses, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
sys.path[:0] = sys.argv[1:]  # tests/tui (test_tui_app), tests (its helpers)
from test_tui_app import painted
from tdbg.protocol.steps import pack_steps, unpack_steps
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run

def converged(msg):
    if msg["type"] != "steps":
        return msg
    rows = [
        dataclasses.replace(r, loss=1e3 if r.step < 50 else 1e-8 * (1 + 1e-4 * (r.step % 7)))
        for r in unpack_steps(msg)
    ]
    return pack_steps(rows, msg["layers"], msg["history"])

async def main():
    messages = [converged(m) for m in synthetic_run(steps=6000, n_layers=2, metrics=False)]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(80, 24)) as pilot:
        while app.state.n_steps < 6000:
            await pilot.pause(0.05)
        await painted(pilot, app)
        print("step 5999" in screen_text(app))

asyncio.run(main())
"""


def test_a_converged_run_s_chart_draws_in_bounded_memory(tmp_path: Path) -> None:
    # A loss that settles to 1e-8 after starting at 1e3: the fitted range is ~1e-12 wide and the
    # first steps lie 1e15 ranges above it. A plotting library that rasterises the line joining
    # them over its whole length asks for gigabytes (plotext did: a 1 M-step replay was killed);
    # the chart must stay small.
    script = tmp_path / "converged.py"
    script.write_text(CONVERGED_RUN)
    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, str(script), str(here), str(here.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout


async def test_the_chart_takes_a_new_palette_or_theme_with_no_data_arriving() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400, n_layers=4, nan_at=380), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await painted(pilot, app)
        chart = app.query_one(LossChart)

        def marker_colours() -> set[tuple[int, int, int]]:
            """The colours of the chart's vertical marker (its runs start with the mark)."""
            found: set[tuple[int, int, int]] = set()
            frame = chart.visual_style.rich_style.color  # the frame: the widget's own colour
            for y in range(2, chart.content_size.height - 2):
                for segment in chart.render_line(y):
                    colour = segment.style.color if segment.style else None
                    if segment.text.startswith("│") and colour and colour != frame:
                        found.add(colour.get_truecolor())
            return found

        await wait_for(pilot, lambda: marker_colours() == {meaning_rgb(app, "bad")}, "the mark")
        before = meaning_rgb(app, "bad")
        await pilot.press("C")  # the replay has ended: no data comes to redraw the chart
        await wait_for(pilot, lambda: meaning_rgb(app, "bad") != before, "the palette changed")
        await wait_for(
            pilot, lambda: marker_colours() == {meaning_rgb(app, "bad")}, "the mark's new colour"
        )

        # A theme picked (the command palette's way) with no data arriving: the lines drawn
        # before hold the old theme's colours until the chart draws them again.
        def braille_colours() -> set[tuple[int, int, int]]:
            found: set[tuple[int, int, int]] = set()
            for y in range(2, chart.content_size.height - 2):
                for segment in chart.render_line(y):
                    colour = segment.style.color if segment.style else None
                    if colour and any(0x2800 < ord(c) < 0x2900 for c in segment.text):
                        found.add(colour.get_truecolor())
            return found

        raw = chart._component_rgb("loss-chart--raw")  # $primary: the theme's own
        assert raw in braille_colours()
        app.theme = "gruvbox"
        await wait_for(
            pilot, lambda: chart._component_rgb("loss-chart--raw") != raw, "the new theme"
        )
        await wait_for(
            pilot,
            lambda: chart._component_rgb("loss-chart--raw") in braille_colours(),
            "the raw loss in the new theme's colour",
        )
