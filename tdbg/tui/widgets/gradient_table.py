"""GradientTable: per-layer gradient norm, log bar, trend sparkline and update ratio; sortable."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from rich.text import Text
from textual.coordinate import Coordinate
from textual.message import Message
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from tdbg.model.names import matching, shorten
from tdbg.protocol.messages.updates import LARGE_RATIO, TINY_RATIO
from tdbg.tui.widgets.fast_cells import FastCells
from tdbg.tui.widgets.glyphs import log_bar, spark
from tdbg.tui.widgets.layer_filter import LayerFilter

SORTS = ("name", "norm", "trend")
VANISHING = 1e-7  # below this a layer's gradient has effectively vanished
EXPLODING = 1e3  # above this it is exploding for almost any model
NORM = 8  # a norm is never negative: no sign column
BAR = 8
TREND = 9
UPDATE = 7  # the update ratio ‖Δw‖/‖w‖: "1.2e-03"
MAX_TREND = 32  # a wide panel gives the trend more history, up to the rows the app sends
MIN_NAME = 12  # the layer column never gets narrower than this
WANT_NAME = 20  # the trend, then the bar, give way (left out, no scrolling) below this
OPTIONAL = ("bar", "trend")  # the columns left out on a narrow panel, the last first


class LayerName(Text):
    """A name cell that knows its layer: shortened names may repeat, the index never does."""

    def __init__(self, layer: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer = layer


class GradientTable(LayerFilter, FastCells):
    """Rows are keyed by layer index; rebuilt only when the layers or the filter change.

    Updates rewrite only the visible rows (and the app throttles them to ~2 Hz); sorting uses
    the numpy arrays, so the order is right for off-screen rows too. Long names are shortened
    from the middle to the layer column's width, so the norm always stays on screen.
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "gradient-table--nonfinite",
        "gradient-table--vanishing",
        "gradient-table--exploding",
        "gradient-table--bar",
        "gradient-table--absent",
    }

    class ColumnsChanged(Message):
        """The panel's width left out or brought back a column (the trend's key hint follows)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.sort_mode = "name"
        self.shared_trend = False  # one log scale for every row's trend, not each row's own
        self.name_filter = ""  # the filter typed after ``/``
        self._components: dict[str, Any] = {}
        self._names: list[str] = []
        self._owners: list[str | None] = []
        self._shown: list[str] = []  # the names as matched: "netG blocks.0.fc.weight"
        self._rows: list[int] = []  # the layers that pass the filter
        self._name_width = 0
        self._trend_width = TREND
        self._short_names: dict[tuple[int, int], str] = {}
        self._norms = np.empty(0)
        self._trends = np.empty(0)
        self._recent = np.empty((0, 0))
        # No norm at all (see RunState.absent): the latest row's, and the recent rows'.
        self._absent = np.zeros(0, dtype=bool)
        self._recent_absent = np.zeros((0, 0), dtype=bool)
        self._gone: frozenset[int] = frozenset()
        self._has_norms = False
        self._lo, self._span = 0.0, 1.0
        self._trend_bounds: tuple[float, float] | None = None
        # Each layer's latest update ratio; the column comes with the first ratios a run sends
        # (older probes and runs without a sampled step yet keep the table as it was).
        self._updates = np.empty(0)
        self._has_updates = False
        self._optional: tuple[str, ...] = OPTIONAL  # the optional columns shown now

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        self._name_key = self.add_column("layer", key="name")
        self.add_column("norm", key="norm", width=NORM)
        if self._has_updates:  # beside the norm: it stays on screen when the bar and trend go
            self.add_column("Δw/w", key="update", width=UPDATE)
        self._add_optional()

    def _add_optional(self) -> None:
        titles = {"bar": ("log bar", BAR), "trend": ("trend", self._trend_width)}
        for key in self._optional:
            title, width = titles[key]
            self.add_column(title, key=key, width=width, default=Text(""))

    @property
    def shows_trend(self) -> bool:
        """The trend column is on screen (a narrow panel leaves it out)."""
        return "trend" in self._optional

    def selected_layer(self) -> int | None:
        """The layer under the row cursor (the inspect cursor reads its norm)."""
        if not self._rows or self.cursor_row < 0:
            return None
        try:
            key = self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key
        except Exception:  # an empty or rebuilding table
            return None
        return int(str(key.value))

    def on_resize(self) -> None:
        self._fit_names()
        self._refresh_visible()  # taller: rows that came into view get their figures

    def watch_show_vertical_scrollbar(self, shown: bool) -> None:
        # A scrollbar that comes (rows enough to scroll) or goes narrows or widens the content
        # without a Resize: fit the names again once the layout has it.
        self.call_after_refresh(self._fit_names)

    def _fit_names(self, rewrite: bool = True) -> None:
        """Size the layer column to the panel: the norm always stays on screen beside it, and
        the bar and trend too while the names get at least WANT_NAME cells; names longer than
        the column are shortened from the middle (the tail says which layer it is)."""
        column = self.columns.get(self._name_key)
        fitted = self._fitted_name_width()
        if column is None or fitted is None:
            return
        width, trend_room, keep = fitted
        self._show_optional(OPTIONAL[:keep])
        self._fit_trend(trend_room)
        if column.auto_width or column.width != width:
            column.auto_width = False
            column.width = width
            self._require_update_dimensions = True
            self.refresh()
        if width != self._name_width:
            self._name_width = width
            for row in self._rows if rewrite else ():
                self.update_cell(str(row), "name", self._name_cell(row))

    def _show_optional(self, keys: tuple[str, ...]) -> None:
        """Show these of the optional columns, no others: what does not fit is left out, not
        scrolled to (a horizontal scrollbar costs a row and hides what it scrolls)."""
        if keys == self._optional:
            return
        for key in self._optional:
            self.remove_column(ColumnKey(key))
        self._optional = keys
        self._add_optional()  # in their order again: the bar before the trend
        self.call_after_refresh(self._refresh_visible)
        self.post_message(self.ColumnsChanged())

    def _fitted_name_width(self) -> tuple[int, int, int] | None:
        """(the layer column's width, the room left for the trend, how many of OPTIONAL fit)
        in the content region the table has now; None before it has one."""
        avail = self.scrollable_content_region.width
        if not avail:
            return None
        pad = 2 * self.cell_padding
        avail -= pad
        needed = max((len(name) for name in self._shown), default=5)
        # The norm (and the update ratio) always stay beside the names; the bar and the trend
        # give way, in that order from the right, when the names would get less than WANT_NAME.
        update = UPDATE + pad if self._has_updates else 0
        others = [NORM + pad + update, BAR + pad, TREND + pad]
        for keep in (3, 2, 1):
            room = avail - sum(others[:keep])
            if room >= min(needed, WANT_NAME):
                break
        width = max(MIN_NAME, min(needed, room))
        return width, avail - width - sum(others[:2]) - pad, keep - 1

    def _fit_trend(self, room: int) -> None:
        """What the names leave on a wide panel goes to the trend: more history per row."""
        width = max(TREND, min(MAX_TREND, room))
        column = self.columns.get(ColumnKey("trend"))
        if column is None or width == self._trend_width:
            return
        self._trend_width = column.width = width
        self._require_update_dimensions = True
        self._fit_trends()
        self._refresh_visible()

    def _name_cell(self, i: int) -> LayerName:
        owner = self._owners[i]
        width = self._name_width or MIN_NAME
        if owner:
            cell = LayerName(i, f"{owner} ", style="bold")
            cell.append(self._short(i, max(1, width - len(owner) - 1)))
            return cell
        return LayerName(i, self._short(i, width))

    def _short(self, i: int, width: int) -> str:
        # Typing a filter rebuilds the rows at each key: shorten each name once per width.
        short = self._short_names.get((i, width))
        if short is None:
            short = self._short_names[i, width] = shorten(self._names[i], width)
        return short

    def _component(self, name: str) -> Any:
        """A component class's style, kept until the styles change: Textual's own cache is
        emptied by every refresh, so each row's update looked them up again (~8 ms at 120x40)."""
        style = self._components.get(name)
        if style is None:
            style = self._components[name] = self.get_component_rich_style(name)
        return style

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._components.clear()

    def _style(self, value: float) -> Any:
        if not math.isfinite(value):
            return self._component("gradient-table--nonfinite")
        if value < VANISHING:
            return self._component("gradient-table--vanishing")
        if value > EXPLODING:
            return self._component("gradient-table--exploding")
        return ""

    def show(
        self,
        names: list[str],
        latest: np.ndarray | None,
        recent: np.ndarray,
        trends: np.ndarray,
        owners: list[str | None] | None = None,
        absent: np.ndarray | None = None,
        recent_absent: np.ndarray | None = None,
        gone: frozenset[int] = frozenset(),
        updates: np.ndarray | None = None,
    ) -> None:
        """Show the latest norms; ``recent`` is (rows x layers) for the trend sparklines;
        ``owners`` (per layer, its model when several are watched) leads each name.
        ``absent`` / ``recent_absent``: where the latest / recent rows have no norm for a
        layer (it had not come yet, or left the model: ``gone``), shown as such, not as NaN."""
        n = len(names)
        self._norms = (
            latest.astype(np.float64)
            if latest is not None and len(latest) == n
            else np.full(n, np.nan)
        )
        self._trends = trends if len(trends) == n else np.full(n, np.nan)
        self._recent = recent if recent.ndim == 2 and recent.shape[1] == n else np.empty((0, n))
        self._absent = absent if absent is not None and absent.shape == (n,) else np.zeros(n, bool)
        self._recent_absent = (
            recent_absent
            if recent_absent is not None and recent_absent.shape == self._recent.shape
            else np.zeros(self._recent.shape, dtype=bool)
        )
        self._gone = gone
        self._updates = updates if updates is not None and len(updates) == n else np.full(n, np.nan)
        if updates is not None and not self._has_updates:
            # The first ratios: the columns again, the ratio's beside the norm (once a run).
            self._has_updates = True
            self.clear(columns=True)
            self._add_columns()
            self._shown = []  # so that the rows are rebuilt below
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
            self._short_names.clear()
            self._owners = list(owners)
            self._shown = shown
            self._rebuild()
        else:
            self._fit_trends()
            self.apply_sort()

    def toggle_shared_trend(self) -> bool:
        self.shared_trend = not self.shared_trend
        self._fit_trends()
        self._refresh_visible()
        return self.shared_trend

    def _rebuild(self) -> None:
        self._rows = matching(self._shown, self.name_filter)
        self._fit_trends()
        self.clear()
        self._fit_names(rewrite=False)  # the rows are added below at the fitted width
        # Figures only for the rows on screen (apply_sort writes them): the rest are filled in
        # when scrolled into view, so a keystroke in the filter costs rows, not sparklines.
        blank = Text("")
        figures = (blank,) * (1 + self._has_updates + len(self._optional))
        for i in self._rows:
            self.add_row(self._name_cell(i), *figures, key=str(i))
        self.apply_sort()

    def _fit_trends(self) -> None:
        """The shared trend scale: the log10 range of the shown layers' recent norms."""
        self._trend_bounds = None
        if not self.shared_trend or not len(self._recent) or not self._rows:
            return
        values = self._recent[:, self._rows][-self._trend_width :].astype(np.float64)
        values = values[np.isfinite(values) & (values > 0)]
        if values.size:
            logs = np.log10(values)
            lo, hi = float(logs.min()), float(logs.max())
            self._trend_bounds = (lo, hi if hi > lo else lo + 1.0)

    def _cells(self, i: int) -> tuple[Text, Text, Text]:
        value = float(self._norms[i])
        absent = bool(self._absent[i]) if i < len(self._absent) else False
        style = self._component("gradient-table--absent") if absent else self._style(value)
        if absent:
            norm = Text(("gone" if i in self._gone else "none").rjust(NORM), style=style)
        else:
            text = f"{value:{NORM}.2e}" if self._has_norms else "n/a".rjust(NORM)
            norm = Text(text, style=style)
        if not self._has_norms or absent:
            bar = Text(" " * BAR)
        elif math.isfinite(value):
            bar_style = self._component("gradient-table--bar")
            bar = Text(log_bar(value, self._lo, self._span, BAR), style=bar_style)
        else:
            bar = Text(log_bar(value, self._lo, self._span, BAR), style=style)
        column = self._recent[:, i] if len(self._recent) else ()
        gaps = self._recent_absent[:, i] if len(self._recent) else None
        trend = Text(
            spark(column, self._trend_width, log=True, bounds=self._trend_bounds, gaps=gaps),
            style=style,
        )
        return norm, bar, trend

    def _update_cell(self, i: int) -> Text:
        """The layer's latest update ratio: dim where tiny (not learning), red where an update
        moves more than LARGE_RATIO of its weights."""
        value = float(self._updates[i]) if i < len(self._updates) else math.nan
        if not math.isfinite(value):
            return Text("·".rjust(UPDATE), style=self._component("gradient-table--absent"))
        style: Any = ""
        if value < TINY_RATIO:
            style = self._component("gradient-table--vanishing")
        elif value > LARGE_RATIO:
            style = self._component("gradient-table--exploding")
        return Text(f"{value:{UPDATE}.1e}" if value else "0".rjust(UPDATE), style=style)

    def _refresh_visible(self) -> None:
        # Only the rows on screen are rewritten: a cell write costs a refresh, and 1,000 layers
        # x 3 cells would take ~60 ms. Rows scrolled into view are rewritten on scroll.
        if not self._rows:
            return
        top = max(0, int(self.scroll_offset.y))
        rows = self.ordered_rows[top : top + max(1, self.size.height)]
        for row in rows:
            key = row.key
            norm, bar, trend = self._cells(int(str(key.value)))
            self.write(key, "norm", norm)
            for column, cell in (("bar", bar), ("trend", trend)):
                if column in self._optional:
                    self.write(key, column, cell)
            if self._has_updates:
                self.write(key, "update", self._update_cell(int(str(key.value))))

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if int(old_value) != int(new_value):
            self._refresh_visible()

    def cycle_sort(self) -> str:
        self.sort_mode = SORTS[(SORTS.index(self.sort_mode) + 1) % len(SORTS)]
        self.apply_sort()
        return self.sort_mode

    def apply_sort(self) -> None:
        if not self._rows:
            return
        if self.sort_mode == "name":
            # Model order, as the probe sent it (grouped by model when several are watched).
            self._sort_by(lambda i: i)
            self._refresh_visible()
            return
        values = self._norms if self.sort_mode == "norm" else self._trends
        absent = self._absent

        def key(i: int) -> tuple[int, float]:
            if i < len(absent) and absent[i]:
                return (2, 0.0)  # no norm (a layer gone or not yet come): last
            v = float(values[i]) if i < len(values) else math.nan
            # Non-finite first: a NaN gradient is the most urgent row on the screen.
            return (0, 0.0) if not math.isfinite(v) else (1, -v)

        self._sort_by(key)
        self._refresh_visible()  # the rows now on screen may be others

    def _sort_by(self, key: Callable[[int], Any]) -> None:
        """Sort the rows by ``key`` of their layer, unless they are in that order already:
        DataTable's sort empties its caches and repaints the whole table, and the rows were
        sorted at each update (by name, the order they already had)."""
        current = [int(str(row.key.value)) for row in self.ordered_rows]
        if sorted(current, key=key) != current:  # stable, as DataTable's sort
            self.sort("name", key=lambda cell: key(cell.layer))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        column = str(event.column_key.value)
        self.sort_mode = {"name": "name", "norm": "norm", "bar": "norm", "trend": "trend"}.get(
            column, "name"
        )
        self.apply_sort()
