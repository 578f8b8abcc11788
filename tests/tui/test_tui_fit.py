"""Nothing that matters cut at 80x24, 100x30, 120x40 and 200x60 (issue 34): the header's state
and step, the chart's caption and bottom line, the gradient table without a horizontal
scrollbar, the y-range without empty rows; and the ranked parts behind it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from rich.text import Text
from test_tui_app import shows
from test_tui_layout import plot_rows, region_lines
from waiting import wait_for

from tdbg.model.chart_axes import y_range
from tdbg.tui.app import make_app
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.fit import fit_parts
from tdbg.tui.widgets.gradient_table import GradientTable

SIZES = ((80, 24), (100, 30), (120, 40), (200, 60))


def test_fit_parts_leaves_out_the_highest_rank_first() -> None:
    parts = [("state", 0), (" elapsed 1:00", 5), (" ETA 30s", 1), (" host", 6)]
    assert fit_parts(parts, 100).plain == "state elapsed 1:00 ETA 30s host"
    assert fit_parts(parts, 26).plain == "state elapsed 1:00 ETA 30s"
    assert fit_parts(parts, 20).plain == "state ETA 30s"
    assert fit_parts(parts, 4).plain == "sta…"  # rank 0 only is cut, with an ellipsis
    styled = fit_parts([(Text("a", "bold"), 0), ("b", 1)], 1)
    assert styled.plain == "a" and styled.spans[0].style == "bold"


def test_y_range_pads_at_most_a_quarter_row() -> None:
    limits = y_range(np.linspace(1.0, 2.0, 50), robust=False, rows=10)
    assert limits is not None
    lo, hi = limits
    assert 1.0 - lo <= 0.025 + 1e-9 and hi - 2.0 <= 0.025 + 1e-9


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_what_matters_shows_whole(size: tuple[int, int]) -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400), dict(RUN)))
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 400, "400 steps")
        await shows(pilot, app, "step 399/1000", "4 micro-batches", "(l)", "sort name (o)")
        header = region_lines(app, app.query_one("#header"))[0]
        assert "step 399/1000" in header and "…" not in header, header
        caption = region_lines(app, app.query_one("#loss-chart"))[0]
        assert "steps 0–399" in caption and "…" not in caption, caption
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count > 0, "the gradient rows")
        # The columns are fitted after a resize, and the scrollbar goes at the refresh after.
        await wait_for(
            pilot,
            lambda: (
                table.virtual_size.width <= table.scrollable_content_region.width
                and not table.show_horizontal_scrollbar
            ),
            "the table's columns within its width, no horizontal scrollbar",
        )
        await wait_for(pilot, lambda: plot_rows(app) > 0, "the plot drawn")
        lines = region_lines(app, app.query_one("#loss-chart"))
        top = next(i for i, line in enumerate(lines) if "┌" in line)
        rows = lines[top + 1 : top + 1 + plot_rows(app)]
        # The top and the bottom plot rows hold the curve (right of the axis: │ or a tick's ┤).
        ends = [re.split("[│┤]", line, maxsplit=1)[1].strip(" │") for line in rows[:1] + rows[-1:]]
        assert rows and all(ends), rows
