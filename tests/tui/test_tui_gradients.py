"""The gradient views in the real app: a fitted heatmap scale, bar floors, trend scales, filter."""

from __future__ import annotations

from typing import Any

import numpy as np
from test_tui_app import ended, shows
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from textual.widgets import Input
from waiting import wait_for

from tdbg.tui.app import TdbgApp, make_app, screen_text
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.gradient_heatmap import LEVELS, GradientHeatmap
from tdbg.tui.widgets.gradient_table import GradientTable

SIZE = (120, 40)
VANISHED = 1  # the synthetic run's layer whose gradient is 1e-9


def run(steps: int = 300, n_layers: int = 8, **kwargs: Any) -> TdbgApp:
    return make_app(
        ReplaySource(synthetic_run(steps=steps, n_layers=n_layers, **kwargs), dict(RUN))
    )


def frame_headings(app: TdbgApp) -> str:
    frame = app.query_one("#grad-panel")
    return f"{frame.border_title} | {frame.border_subtitle}"


async def focus_gradients(pilot: Pilot[Any], app: TdbgApp) -> None:
    """The gradient panel's keys work where its views have the focus (tab reaches it)."""
    table = app.query_one(GradientTable)
    while not table.has_focus:
        await pilot.press("tab")


async def test_heatmap_scale_fits_the_norms_and_says_so() -> None:
    app = run(n_layers=40)  # a scrollbar: the heatmap is laid out twice
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        await pilot.press("h")
        steps, _ = app.state.grads.matrix()
        caption = f"steps {int(steps[0])}…{int(steps[-1])}"  # not "steps 0…0"
        text = await shows(pilot, app, caption, "NaN/Inf", "zero")
        legend = text.split("\n")[
            [i for i, line in enumerate(text.split("\n")) if caption in line][0]
        ]
        assert "e-" in legend  # the scale's ends, e.g. "≤2e-3 ████ 7e-1"
        heatmap = app.query_one(GradientHeatmap)
        levels = heatmap._levels
        # One column a sampled step, as many as the width holds (not the 1 of a hidden widget).
        assert levels.shape[1] >= heatmap.scrollable_content_region.width // 2
        typical = np.delete(levels, VANISHED, axis=0)  # the vanished layer takes the low end
        # The typical layers (norms between 1e-2 and 1) use most of the ramp, not one green.
        assert typical.max() - typical[typical >= 0].min() >= LEVELS // 2
        assert (levels[VANISHED] == 0).all()


async def test_smallest_layer_keeps_a_bar() -> None:
    app = run()
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        bar = str(table.get_cell(str(VANISHED), "bar"))
        assert bar.startswith("█") and bar[1:].strip() == ""  # the floor: one cell
        latest = app.state.grads.latest()
        assert latest is not None
        largest = int(np.nanargmax(latest))
        assert str(table.get_cell(str(largest), "bar")) == "█" * 8


async def test_t_puts_every_trend_on_one_scale() -> None:
    app = run()
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        await focus_gradients(pilot, app)
        assert "trend: row (t)" in frame_headings(app)
        latest = app.state.grads.latest()
        assert latest is not None
        largest = str(int(np.nanargmax(latest)))
        await pilot.press("t")
        await wait_for(pilot, lambda: "trend: all (t)" in frame_headings(app), "shared")
        # On one scale the vanished layer lies flat at the bottom, the largest near the top.
        assert set(str(table.get_cell(str(VANISHED), "trend"))) == {"▁"}
        assert set(str(table.get_cell(largest, "trend"))) <= set("▆▇█")
        await shows(pilot, app, "trend: all (t)")
        await pilot.press("t")
        await wait_for(pilot, lambda: "trend: row (t)" in frame_headings(app), "per row")
        assert set(str(table.get_cell(str(VANISHED), "trend"))) != {"▁"}


async def test_slash_filters_the_table_and_heatmap_as_you_type() -> None:
    app = run()
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        heatmap = app.query_one(GradientHeatmap)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        await focus_gradients(pilot, app)
        await pilot.press("slash")
        field = app.query_one("#grad-filter", Input)
        await wait_for(pilot, lambda: field.has_focus and field.display, "the filter field")
        await pilot.press("a", "t", "t", "n")  # letters that are keys elsewhere type here
        await wait_for(pilot, lambda: table.row_count == 2, "two attn rows")
        text = await shows(pilot, app, "filter: attn (2 of 8)", "1.attn.weight")
        assert "mlp.weight" not in text
        await pilot.press("enter")  # keeps the filter, the keys go back to the table
        await wait_for(pilot, lambda: table.has_focus, "the table focused")
        await pilot.press("h")
        await wait_for(pilot, lambda: heatmap.matched == 2, "the heatmap filtered")
        text = await shows(pilot, app, "filter: attn (2 of 8)", "NaN/Inf")
        assert "mlp.weight" not in text
        await pilot.press("h")
        await pilot.press("escape")
        await wait_for(pilot, lambda: table.row_count == 8, "every row back")
        await wait_for(pilot, lambda: "filter:" not in screen_text(app), "the filter cleared")
        assert heatmap.matched == 8 and not field.display


async def test_long_names_leave_the_norms_on_screen() -> None:
    messages = synthetic_run(steps=60, n_layers=8)
    for message in messages:
        if message.get("type") == "layers":
            message["names"] = [
                f"encoder.transformer.layers.{i}.self_attention.output_projection.weight"
                for i in range(len(message["names"]))
            ]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        latest = app.state.grads.latest()
        assert latest is not None
        norms = [f"{float(v):.2e}" for v in latest]
        text = await shows(pilot, app, *norms)  # every norm on screen beside its name
        assert "…" in text and "output_projection.weight" not in text  # cut from the middle
        for i in range(8):
            name = str(table.get_cell(str(i), "name"))
            assert name.endswith("weight") and "…" in name


class HeatmapApp(App[None]):
    def compose(self) -> ComposeResult:
        yield GradientHeatmap()


async def test_heatmap_marks_nonfinite_and_zero_cells_apart() -> None:
    names = ["enc.0.weight", "enc.1.weight", "enc.2.weight", "head.weight"]
    rows = np.full((20, 4), 0.1, dtype=np.float32)
    rows[:, 3] = np.logspace(-3, 1, 20)  # one layer that grows through four decades
    rows[10:, 1] = np.nan
    rows[:, 2] = 0.0
    app = HeatmapApp()
    async with app.run_test(size=(60, 8)) as pilot:
        heatmap = app.query_one(GradientHeatmap)
        heatmap.show(names, np.arange(100, 120), rows)
        text = await until_screen(pilot, app, "enc.2.weight")
        lines = {line.split(" ", 1)[0]: line for line in text.split("\n")}
        assert "×" in lines["enc.1.weight"] and "░" not in lines["enc.1.weight"]
        assert set(lines["enc.2.weight"].split(" ", 1)[1].strip()) == {"░"}
        legend = text.split("\n")[0]
        # Fitted to the flat layers (0.1): the growing one runs off both ends, and says so.
        assert legend.startswith("≤3e-2 ") and "≥3e-1 " in legend and "steps 100…119" in legend
        heatmap.filter("enc 1")
        text = await until_screen(pilot, app, "enc.1.weight")
        assert "enc.0.weight" not in text and heatmap.matched == 1 and heatmap.total == 4


async def test_a_narrow_heatmap_s_legend_drops_whole_words_never_cuts_them() -> None:
    names = ["a", "b"]
    rows = np.full((30, 2), 0.1, dtype=np.float32)
    rows[:, 1] = np.logspace(-3, 1, 30)
    sizes = ((60, True, "NaN/Inf"), (38, False, "NaN/Inf"), (30, False, "NaN"))
    for width, caption, words in sizes:
        app = HeatmapApp()
        async with app.run_test(size=(width, 6)) as pilot:
            app.query_one(GradientHeatmap).show(names, np.arange(400, 430), rows)
            text = await until_screen(pilot, app, "≥")
            legend = text.split("\n")[0].rstrip()
            assert ("· steps 400…429" in legend) is caption, legend
            assert words in legend and len(legend) <= width
            # The legend ends with a whole word: the steps shown or the zero mark's.
            assert legend.endswith(("steps 400…429", "zero", "░ 0")), legend


async def until_screen(pilot: Pilot[Any], app: App[None], needle: str) -> str:
    await wait_for(pilot, lambda: needle in screen_text(app), needle)
    return screen_text(app)


async def test_rows_scrolled_into_view_get_their_figures() -> None:
    app = run(steps=40, n_layers=200)
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 200, "the table's rows")
        await focus_gradients(pilot, app)
        while table.scroll_offset.y < table.max_scroll_y or not table.max_scroll_y:
            await pilot.press("pagedown")
        await pilot.pause()
        top = int(table.scroll_offset.y)
        for row in table.ordered_rows[top : top + table.size.height - 1]:
            assert str(table.get_cell(row.key, "norm")).strip(), row.key.value
        assert "199" in str(table.ordered_rows[-1].key.value)
        await shows(pilot, app, "49.proj.weight")  # the last layer, blocks.49.proj.weight


async def test_a_wide_panel_gives_the_trend_more_history() -> None:
    app = run(steps=60, n_layers=8)
    async with app.run_test(size=(200, 60)) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        await wait_for(pilot, lambda: len(str(table.get_cell("3", "trend"))) > 20, "a long trend")
        name = "netG blocks.0.attn.weight"
        await shows(pilot, app, name)  # the names keep their room


async def test_slash_and_t_work_while_another_panel_has_the_focus() -> None:
    app = run()
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 8, "the table's rows")
        assert not table.has_focus  # the loss chart has it at start-up
        await pilot.press("t")
        await wait_for(pilot, lambda: "trend: all" in frame_headings(app), "one trend scale")
        await pilot.press("slash")
        field = app.query_one("#grad-filter", Input)
        await wait_for(pilot, lambda: field.has_focus and field.display, "the filter field")
        await pilot.press("a", "t", "t", "n")
        await wait_for(pilot, lambda: table.row_count == 2, "two attn rows")


class TableApp(App[None]):
    CSS = "GradientTable { height: 8; width: 60; }"

    def compose(self) -> ComposeResult:
        yield GradientTable()


async def test_names_are_refit_when_the_vertical_scrollbar_comes_or_goes() -> None:
    """Rows enough to scroll bring a vertical scrollbar, which narrows the table's content
    without resizing the table: the layer column is fitted again to what is left (seen: a
    snapshot of the 80x24 screen under load kept the names one cell too wide)."""
    app = TableApp()
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.query_one(GradientTable)

        def names(n: int) -> list[str]:
            return [f"model.blocks.{i}.attention.projection.weight" for i in range(n)]

        for n in (3, 40, 3):
            table.show(names(n), np.ones(n), np.empty((0, n)), np.ones(n))
            await wait_for(
                pilot,
                lambda n=n: table.show_vertical_scrollbar == (n > 6),  # type: ignore[misc]
                "the scrollbar following the rows",
            )
            await wait_for(
                pilot,
                lambda: table._name_width == (table._fitted_name_width() or (0, 0))[0],
                "the names fitted to the region the table has now",
            )


async def test_a_one_step_nan_shows_however_many_steps_share_a_column() -> None:
    # 400 sampled steps on a 60-cell row: each column holds several. The NaN at step 123 (in
    # no column's first step) and the one exploding step are its columns' value, not skipped.
    names = ["enc.weight", "head.weight"]
    rows = np.full((400, 2), 0.1, dtype=np.float32)
    rows[123, 0] = np.nan
    rows[250, 1] = 1e3
    app = HeatmapApp()
    async with app.run_test(size=(60, 8)) as pilot:
        heatmap = app.query_one(GradientHeatmap)
        heatmap.show(names, np.arange(400), rows)
        text = await until_screen(pilot, app, "head.weight")
        lines = {line.split(" ", 1)[0]: line for line in text.split("\n")}
        assert lines["enc.weight"].count("×") == 1
        levels = heatmap._levels
        assert levels.shape[1] < 100 and (levels[1] == levels[1].max()).sum() == 1
        assert "steps 0…399" in text
