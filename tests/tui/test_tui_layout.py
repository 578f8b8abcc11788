"""The monitor's layout at the sizes people have (issue 11): what each size keeps on screen,
panels that collapse to one line, z that maximises the focused panel, x that closes a dive."""

from __future__ import annotations

import re
from typing import Any

from test_tui_app import ended, shows
from test_tui_deep import PROFILE_ARGS, FeedSource, started
from textual.pilot import Pilot
from textual.widget import Widget
from waiting import wait_for

from tdbg.protocol.steps import pack_steps
from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import (
    RUN,
    job_messages,
    profile_result,
    step_records,
    synthetic_run,
)

NORM = re.compile(r"\d\.\d\de[-+]\d\d")  # a norm as the gradient table prints it: 7.29e-03


def region_lines(app: TdbgApp, widget: Widget) -> list[str]:
    """What ``widget`` shows, line by line, read off the composited screen."""
    region = widget.content_region
    lines = screen_text(app).split("\n")
    return [line[region.x : region.right] for line in lines[region.y : region.bottom]]


def plot_rows(app: TdbgApp) -> int:
    """The loss chart's plot rows on screen: the lines between its frame's top and bottom."""
    lines = region_lines(app, app.query_one("#loss-chart"))
    top = next((i for i, line in enumerate(lines) if "┌" in line), None)
    bottom = next((i for i, line in enumerate(lines) if "└" in line), None)
    if top is None or bottom is None:
        return 0
    return bottom - top - 1


def layers_with_norms(app: TdbgApp) -> int:
    return sum(1 for line in region_lines(app, app.query_one("#grad-table")) if NORM.search(line))


def demo_app() -> TdbgApp:
    """The demo's run: two models, user metrics (the metrics table), 12 layers."""
    return make_app(ReplaySource(synthetic_run(steps=400, n_layers=12), dict(RUN)))


async def test_80x24_keeps_8_loss_rows_and_5_layers_with_their_norms() -> None:
    app = demo_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ended(pilot, app)
        monitor = app.monitor
        assert monitor.has_class("-metrics")  # the case that left the loss 3 rows
        await wait_for(pilot, lambda: plot_rows(app) >= 8, "8 plot rows")
        await wait_for(pilot, lambda: layers_with_norms(app) >= 5, "5 layers with norms")
        # The metrics table and the memory panel are one line each; alerts are still there.
        await shows(pilot, app, "Metrics (5):", "loss/netG 0.9131")
        # Whole figures, never one cut mid-number: the words "CPU run, no GPU" give way first.
        await shows(pilot, app, "Memory RAM 30 GiB/128 GiB", "zero_grad")


async def test_60x18_still_shows_the_loss_and_the_gradients() -> None:
    app = demo_app()
    async with app.run_test(size=(60, 18)) as pilot:
        await ended(pilot, app)
        await wait_for(pilot, lambda: plot_rows(app) >= 3, "loss plot rows")
        table = app.query_one("#grad-table")
        await wait_for(
            pilot,
            lambda: sum(1 for line in region_lines(app, table) if "weight" in line) >= 5,
            "5 layers",
        )
        text = await shows(pilot, app, "Alerts")
        assert "Memory" not in text and "Metrics" not in text  # made way
        assert "Alerts" in text


async def loss_rows_at(size: tuple[int, int]) -> int:
    app = demo_app()
    async with app.run_test(size=size) as pilot:
        await ended(pilot, app)
        await wait_for(pilot, lambda: plot_rows(app) >= 8, "8 plot rows")
        await wait_for(pilot, lambda: layers_with_norms(app) == 12, "12 layers with norms")
        return plot_rows(app)


async def test_larger_terminals_give_the_rows_to_the_charts() -> None:
    small, medium, large = [await loss_rows_at(s) for s in ((80, 24), (120, 40), (200, 60))]
    assert small < medium < large


async def test_panels_with_nothing_to_say_are_one_dim_line() -> None:
    run = synthetic_run(steps=100, true_numbers=False, tokens=False)
    app = make_app(ReplaySource(run, dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await ended(pilot, app)
        text = await shows(
            pilot, app, "CPU run · no GPU", "samples/s", "grads every step", "Press p to profile"
        )
        # A CPU run: no orange NVML / CUDA lines, one line saying why there is no GPU.
        assert "CPU run · no GPU" in text
        assert "NVML" not in text and "CUDA: not in use" not in text
        # A run that counts no tokens: no "n/a tokens/s".
        assert "samples/s" in text and "tokens/s" not in text
        assert "grads every step" in text
        # The deep-dive panel with no dive: the keys, one line, no border.
        strip = app.query_one("#profiler-panel")
        assert strip.size.height == 1 and "Press p to profile" in text


async def zoom(pilot: Pilot[Any], app: TdbgApp, focus: str, panel: str) -> None:
    """Focus what tab reaches in ``panel`` (the panel, or the widget with keys of its own inside
    it), press z: the panel fills the screen, its full form; escape gives the layout back."""
    monitor = app.monitor
    widget = monitor.query_one(focus)
    if not widget.focusable:
        widget = next(w for w in widget.query("*") if w.focusable)
    widget.focus()
    await wait_for(pilot, lambda: app.focused is widget, f"{focus} focused")
    await pilot.press("z")
    target = monitor.query_one(panel)
    await wait_for(pilot, lambda: monitor.maximized is target, f"{panel} maximized")
    # Truly full screen: every row between the header and the status line and footer.
    await wait_for(pilot, lambda: target.size.height >= 24 - 4, f"{panel} full height")
    if panel == "#memory-panel":  # its full form, not the one-line summary
        await wait_for(pilot, lambda: "RSS 2.5 GiB" in screen_text(app), "full memory")
        assert "host  RAM" in screen_text(app)
    await pilot.press("escape")
    await wait_for(pilot, lambda: monitor.maximized is None, f"{panel} restored")


async def test_z_maximises_the_focused_panel_and_escape_gives_it_back() -> None:
    app = demo_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ended(pilot, app)
        await zoom(pilot, app, "#grad-table", "#grad-panel")
        await zoom(pilot, app, "#alerts", "#alerts-panel")
        await zoom(pilot, app, "#loss-panel", "#loss-panel")
        await zoom(pilot, app, "#memory-panel", "#memory-panel")
        await wait_for(pilot, lambda: plot_rows(app) >= 8, "the layout back")


async def test_x_closes_the_deep_dive_panel_until_the_next_dive() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot, app, source)
        monitor: MonitorScreen = app.monitor
        panel = monitor.query_one("#profiler-panel")
        source.feed(*job_messages(1, "profile", PROFILE_ARGS, profile_result()))
        await wait_for(pilot, lambda: monitor.has_class("-deep"), "the dive shown")
        await wait_for(pilot, lambda: panel.size.height > 3, "the panel open")
        await pilot.press("x")
        await wait_for(pilot, lambda: not monitor.has_class("-deep"), "closed")
        await wait_for(pilot, lambda: panel.size.height == 1, "one line")
        await wait_for(pilot, lambda: "closed (x) · d: show it again" in screen_text(app), "hint")
        # A newer dive opens it again.
        source.feed(*job_messages(2, "profile", PROFILE_ARGS, profile_result(), start=200))
        await wait_for(pilot, lambda: monitor.has_class("-deep"), "reopened by a new dive")
        await pilot.press("x")
        await wait_for(pilot, lambda: not monitor.has_class("-deep"), "closed again")
        await pilot.press("d")  # d opens it again too
        await wait_for(pilot, lambda: monitor.has_class("-deep"), "reopened by d")


async def test_panels_hidden_by_a_zoom_are_not_painted_until_it_ends() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot, app, source)
        monitor = app.monitor
        grads = monitor.query_one("#grad-panel")
        await wait_for(pilot, lambda: "step 119" in str(grads.border_subtitle), "grads at 119")
        await pilot.press("z")  # nothing focused: the loss panel
        loss = monitor.query_one("#loss-panel")
        await wait_for(pilot, lambda: monitor.maximized is loss, "the loss zoomed")
        source.feed(pack_steps(step_records(120, 40, n_layers=6), 6))
        # The zoomed panel follows the run; the gradient panel under it is left alone.
        await wait_for(pilot, lambda: "0–159" in screen_text(app), "the loss at step 159")
        assert "step 119" in str(grads.border_subtitle)
        await pilot.press("escape")
        await wait_for(pilot, lambda: monitor.maximized is None, "the zoom ended")
        # Back, every panel is painted at once (not at the next data).
        await wait_for(pilot, lambda: "step 159" in str(grads.border_subtitle), "grads at 159")
