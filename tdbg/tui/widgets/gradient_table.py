"""GradientTable: per-layer gradient norm, a log-scale bar and a trend sparkline; sortable."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from tdbg.tui.widgets.glyphs import gauge, spark

SORTS = ("name", "norm", "trend")
VANISHING = 1e-7  # below this a layer's gradient has effectively vanished
EXPLODING = 1e3  # above this it is exploding for almost any model
BAR = 8
TREND = 10


class GradientTable(DataTable[Any]):
    """Rows are keyed by layer index; rebuilt only when the layers change.

    Updates rewrite only the visible rows (and the app throttles them to ~2 Hz); sorting uses
    the numpy arrays, so the order is right for off-screen rows too.
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "gradient-table--nonfinite",
        "gradient-table--vanishing",
        "gradient-table--exploding",
        "gradient-table--bar",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.sort_mode = "name"
        self._names: list[str] = []
        self._shown: list[str] = []  # the name cells as text: "netG blocks.0.fc.weight"
        self._norms = np.empty(0)
        self._trends = np.empty(0)
        self._recent = np.empty((0, 0))
        self._has_norms = False
        self._lo, self._span = 0.0, 1.0

    def on_mount(self) -> None:
        self._name_key = self.add_column("layer", key="name")
        self.add_column("norm", key="norm", width=9)
        self.add_column("log bar", key="bar", width=BAR)
        self.add_column("trend", key="trend", width=TREND)

    def on_resize(self) -> None:
        self._fit_names()

    def _fit_names(self) -> None:
        """On a narrow panel (80 columns), cap the layer column so the norm stays on screen
        beside it: a long (model-prefixed) name is cut rather than the number; the bar and
        trend scroll off to the right."""
        column = self.columns.get(self._name_key)
        norm = self.columns.get(ColumnKey("norm"))
        if column is None or norm is None or not self.size.width:
            return
        room = self.size.width - norm.get_render_width(self) - 2 * self.cell_padding - 1
        needed = max((len(name) for name in self._shown), default=5)
        width = max(12, min(needed, room))
        if column.auto_width or column.width != width:
            column.auto_width = False
            column.width = width
            self._require_update_dimensions = True
            self.refresh()

    def _style(self, value: float) -> Any:
        if not math.isfinite(value):
            return self.get_component_rich_style("gradient-table--nonfinite")
        if value < VANISHING:
            return self.get_component_rich_style("gradient-table--vanishing")
        if value > EXPLODING:
            return self.get_component_rich_style("gradient-table--exploding")
        return ""

    def show(
        self,
        names: list[str],
        latest: np.ndarray | None,
        recent: np.ndarray,
        trends: np.ndarray,
        owners: list[str | None] | None = None,
    ) -> None:
        """Show the latest norms; ``recent`` is (rows x layers) for the trend sparklines;
        ``owners`` (per layer, its model when several are watched) leads each name."""
        n = len(names)
        self._norms = (
            latest.astype(np.float64)
            if latest is not None and len(latest) == n
            else np.full(n, np.nan)
        )
        self._trends = trends if len(trends) == n else np.full(n, np.nan)
        self._recent = recent if recent.ndim == 2 and recent.shape[1] == n else np.empty((0, n))
        self._has_norms = latest is not None
        finite = self._norms[np.isfinite(self._norms) & (self._norms > 0)]
        with np.errstate(all="ignore"):
            self._lo = float(np.log10(finite.min())) if finite.size else 0.0
            hi = float(np.log10(finite.max())) if finite.size else 1.0
        self._span = hi - self._lo if hi > self._lo else 1.0
        owners = owners if owners is not None and len(owners) == n else [None] * n
        shown = [f"{o} {name}" if o else name for o, name in zip(owners, names, strict=True)]
        if names != self._names or shown != self._shown:
            self._names = list(names)
            self._shown = shown
            self.clear()
            for i, name in enumerate(names):
                cell = Text(name)
                if owners[i]:
                    cell = Text.assemble((f"{owners[i]} ", "bold"), name)
                self.add_row(cell, *self._cells(i), key=str(i))
            self._fit_names()
        self.apply_sort()

    def _cells(self, i: int) -> tuple[Text, Text, Text]:
        value = float(self._norms[i])
        style = self._style(value)
        norm = Text(f"{value:9.2e}" if self._has_norms else "      n/a", style=style)
        frac = None
        if value > 0 and math.isfinite(value):
            frac = (math.log10(value) - self._lo) / self._span
        bar = Text(gauge(frac, BAR), style=self.get_component_rich_style("gradient-table--bar"))
        column = self._recent[:, i] if len(self._recent) else ()
        trend = Text(spark(column, TREND, log=True), style=style)
        return norm, bar, trend

    def _refresh_visible(self) -> None:
        # Only the rows on screen are rewritten: a cell write costs a refresh, and 1,000 layers
        # x 3 cells would take ~60 ms. Rows scrolled into view are rewritten on scroll.
        if not self._names:
            return
        top = max(0, int(self.scroll_offset.y))
        rows = self.ordered_rows[top : top + max(1, self.size.height)]
        for row in rows:
            key = row.key
            norm, bar, trend = self._cells(int(str(key.value)))
            self.update_cell(key, "norm", norm)
            self.update_cell(key, "bar", bar)
            self.update_cell(key, "trend", trend)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if int(old_value) != int(new_value):
            self._refresh_visible()

    def cycle_sort(self) -> str:
        self.sort_mode = SORTS[(SORTS.index(self.sort_mode) + 1) % len(SORTS)]
        self.apply_sort()
        return self.sort_mode

    def apply_sort(self) -> None:
        if not self._names:
            return
        index = {name: i for i, name in enumerate(self._shown)}
        if self.sort_mode == "name":
            # Model order, as the probe sent it (grouped by model when several are watched).
            self.sort("name", key=lambda name: index[str(name)])
            self._refresh_visible()
            return
        values = self._norms if self.sort_mode == "norm" else self._trends

        def key(cell: object) -> tuple[int, float]:
            i = index[str(cell)]
            v = float(values[i]) if i < len(values) else math.nan
            # Non-finite first: a NaN gradient is the most urgent row on the screen.
            return (0, 0.0) if not math.isfinite(v) else (1, -v)

        self.sort("name", key=key)
        self._refresh_visible()  # the rows now on screen may be others

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        column = str(event.column_key.value)
        self.sort_mode = {"name": "name", "norm": "norm", "bar": "norm", "trend": "trend"}.get(
            column, "name"
        )
        self.apply_sort()
