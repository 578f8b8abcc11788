"""MetricTable: the latest value of every user metric (name, value, step, min, max, trend).

Rows are keyed by metric name, added as names arrive (the probe caps names itself); a NaN or inf
value is shown as such and highlighted, and a metric that ever was non-finite keeps a ``!``.
Enter on a row asks the screen to chart that metric in the loss panel.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from rich.text import Text
from textual.coordinate import Coordinate

from tdbg.format import fmt, fmt_loss
from tdbg.model.cursor import metric_at
from tdbg.model.metrics import MetricSeries, MetricStore, loss_like
from tdbg.tui.widgets.fast_cells import FastCells
from tdbg.tui.widgets.glyphs import spark

TREND = 12
COLUMNS = ("name", "value", "step", "min", "max", "trend")


class MetricTable(FastCells):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "metric-table--nonfinite",
        "metric-table--loss",
        "metric-table--dim",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self._names: list[str] = []
        self._revision = -1
        self._store: MetricStore | None = None
        self._colours: dict[str, str] = {}
        self.cursor: int | None = None  # the inspect cursor's step: values read there

    def on_mount(self) -> None:
        self.add_column("metric", key="name")
        self.add_column(Text("value", justify="right"), key="value", width=10)
        self.add_column(Text("step", justify="right"), key="step", width=7)
        self.add_column(Text("min", justify="right"), key="min", width=10)
        self.add_column(Text("max", justify="right"), key="max", width=10)
        self.add_column("trend", key="trend", width=TREND)

    def selected(self) -> str | None:
        """The metric under the cursor."""
        if not self._names or self.cursor_row < 0:
            return None
        try:
            key = self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key
        except Exception:  # an empty or rebuilding table
            return None
        return str(key.value)

    def show(
        self,
        store: MetricStore,
        colours: dict[str, str] | None = None,
        cursor: int | None = None,
    ) -> None:
        """Show ``store``; ``colours`` names the metrics drawn on the loss chart (their
        name is written in their line's colour: the table is the chart's legend too)."""
        colours = colours or {}
        if (
            store is self._store
            and store.revision == self._revision
            and store.names == self._names
            and colours == self._colours
            and cursor == self.cursor
        ):
            return
        self._colours = colours
        self.cursor = cursor
        self._revision = store.revision
        names = store.names
        if names[: len(self._names)] != self._names:  # another run (a restart): start over
            self.clear()
            self._names = []
        for name in names[len(self._names) :]:
            self.add_row(*self._cells(store[name]), key=name)
            self._names.append(name)
        self._store = store
        self._refresh_visible()

    def _refresh_visible(self) -> None:
        # Only the rows on screen are rewritten (a cell write costs a refresh); rows scrolled
        # into view are rewritten on scroll.
        store = self._store
        if store is None or not self._names:
            return
        top = max(0, int(self.scroll_offset.y))
        for name in self._names[top : top + max(1, self.size.height)]:
            if name not in store:
                continue
            cells = self._cells(store[name])
            for column, cell in zip(COLUMNS, cells, strict=True):
                self.write(name, column, cell)  # unchanged cells are left alone

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if int(old_value) != int(new_value):
            self._refresh_visible()

    def _cells(self, series: MetricSeries) -> tuple[Text, Text, Text, Text, Text, Text]:
        bad = self.get_component_rich_style("metric-table--nonfinite")
        dim = self.get_component_rich_style("metric-table--dim")
        last = series.last
        name = Text(series.name)
        colour = self._colours.get(series.name)
        if colour:
            name.stylize(colour)
        elif loss_like(series.name):
            name.stylize(self.get_component_rich_style("metric-table--loss"))
        if series.nonfinite:
            name.append(" !", bad)
        last_step = series.last_step
        if self.cursor is not None:  # the inspect cursor: the point at or before its step
            point = metric_at(series, self.cursor)
            last, last_step = (None, None) if point is None else (point[1], point[0])
        nonfinite = last is not None and not math.isfinite(last)
        value = Text(f"{fmt_loss(last):>10}", style=bad if nonfinite else "")
        step = Text(f"{fmt(last_step, 'd'):>7}", style=dim)
        lo = Text(f"{fmt_loss(None if math.isnan(series.lo) else series.lo):>10}")
        hi = Text(f"{fmt_loss(None if math.isnan(series.hi) else series.hi):>10}")
        _, values = series.step_values
        trend = Text(spark(values[-TREND:], TREND), style=dim)
        return name, value, step, lo, hi, trend
