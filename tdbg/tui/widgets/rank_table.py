"""RankTable: one row per rank of a job, worst first; Enter on a row opens that rank's screen."""

from __future__ import annotations

import math
from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from tdbg.format import fmt_bytes, fmt_loss, fmt_us
from tdbg.model.job_table import RankRow
from tdbg.tui.colours import meaning

COLUMNS = (
    "rank",
    "node",
    "step",
    "step time",
    "data wait",
    "fwd/bwd/opt",
    "loss",
    "grad norm",
    "memory",
    "GPU util",
    "alerts",
)
BAD_ALERTS = frozenset({"hang", "rank_divergence", "nonfinite_ranks"})  # the rest: warnings
# Left out in this order when the panel is too narrow for every column, so that no horizontal
# scrollbar takes a row and hides the alerts; a rank's own screen (Enter) shows them all.
DROP_ORDER = ("GPU util", "memory", "data wait", "fwd/bwd/opt", "grad norm", "node")


def _time(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else fmt_us(seconds * 1e6)


def _gpu_util(row: RankRow) -> Text:
    if not row.on_gpu:
        return Text("n/a", style="dim")  # a CPU rank: no GPU to be busy
    return Text("-" if row.gpu_util is None else f"{row.gpu_util:.0f}%")


class RankTable(DataTable[Text]):
    """Dumb view: ``show(rows)`` puts the rows on screen, keeping a cursor moved off the top
    row on the same rank, and leaves out the columns the panel is too narrow for.

    Rows in the same order as last time get only their changed cells rewritten: clearing and
    re-adding 64 rows re-measured every cell each frame (benchmarks/job_tui.py)."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self._shown: list[list[Text]] = []
        self._order: list[int] = []
        self._visible: tuple[str, ...] = COLUMNS
        for name in COLUMNS:
            self.add_column(name, key=name)

    def on_resize(self) -> None:
        self._fit()

    def watch_show_vertical_scrollbar(self, shown: bool) -> None:
        # A vertical scrollbar that comes or goes changes the width without a Resize.
        self.call_after_refresh(self._fit)

    def _fit(self) -> None:
        """The columns that fit the panel now, the table rebuilt if they changed."""
        if not self.is_mounted:
            return
        visible = self._columns_that_fit(self._shown)
        if visible != self._visible:
            self._rebuild(self._order, self._shown, visible)

    def _columns_that_fit(self, cells: list[list[Text]]) -> tuple[str, ...]:
        """COLUMNS less those of DROP_ORDER, in turn, that the panel's width cannot hold with
        ``cells`` in them (all of them before the table has a width)."""
        avail = self.scrollable_content_region.width
        if not avail:
            return self._visible
        pad = 2 * self.cell_padding
        need = {
            name: max([cell_len(name), *(row[i].cell_len for row in cells)]) + pad
            for i, name in enumerate(COLUMNS)
        }
        visible = list(COLUMNS)
        for name in DROP_ORDER:
            if sum(need[column] for column in visible) <= avail:
                break
            visible.remove(name)
        return tuple(visible)

    def _rebuild(self, order: list[int], cells: list[list[Text]], visible: tuple[str, ...]) -> None:
        """Every row again, in ``order``, under the ``visible`` columns (those that fit); the
        cursor as in show()."""
        # The cursor follows its rank to its new row, unless it is on the top row: there it
        # stays on the worst rank (a cursor nobody moved started there and is not a choice).
        keep = self.selected_rank if self.cursor_row > 0 else None
        if visible != self._visible:
            self._visible = visible
            self.clear(columns=True)
            for name in visible:
                self.add_column(name, key=name)
        else:
            self.clear()
        shown = [COLUMNS.index(name) for name in visible]
        for rank, row_cells in zip(order, cells, strict=True):
            self.add_row(*(row_cells[i] for i in shown), key=str(rank))
        self._order, self._shown = order, cells
        if keep is not None and keep in order:
            self.move_cursor(row=order.index(keep))

    def show(self, rows: list[RankRow]) -> None:
        order = [r.rank for r in rows]
        cells = [self._cells(r, self.app) for r in rows]
        visible = self._columns_that_fit(cells)
        if order == self._order and visible == self._visible:
            drawn = set(visible)
            for rank, old, new in zip(order, self._shown, cells, strict=True):
                for column, before, after in zip(COLUMNS, old, new, strict=True):
                    if before != after and column in drawn:
                        # Only a wider cell widens its column: a narrower one made Textual
                        # re-measure the whole column (every row), each frame.
                        width = self.columns[ColumnKey(column)].content_width
                        wider = cell_len(after.plain) > width
                        self.update_cell(str(rank), column, after, update_width=wider)
            self._shown = cells
            if not self._too_wide(cells):
                return
        self._rebuild(order, cells, visible)

    def _too_wide(self, cells: list[list[Text]]) -> bool:
        """The columns as drawn overflow the panel and building the table again would narrow
        one: show() widens a column for a wider cell and never narrows it (that re-measures
        every row), so a cell that was long once (an alert since gone) keeps its column wide.
        (A panel too narrow even for the columns that always stay is left as it is, not built
        again at every show.)"""
        avail = self.scrollable_content_region.width
        pad = 2 * self.cell_padding
        drawn = {str(key.value): column.content_width for key, column in self.columns.items()}
        if not avail or sum(width + pad for width in drawn.values()) <= avail:
            return False
        return any(
            width > max([cell_len(name), *(row[COLUMNS.index(name)].cell_len for row in cells)])
            for name, width in drawn.items()
        )

    @property
    def selected_rank(self) -> int | None:
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        return int(key) if key is not None else None

    @staticmethod
    def _cells(row: RankRow, app: Any = None) -> list[Text]:
        phases = "/".join(
            _time(t) for t in (row.forward_time, row.backward_time, row.optimizer_time)
        )
        if row.alerts:
            # The palette's colours (colour-blind safe when chosen), not fixed red and green.
            bad = row.alerts[0] in BAD_ALERTS
            style = meaning(app, "bad", bold=True) if bad else meaning(app, "warn")
            alerts = Text(" ".join(row.alerts), style=style)
        elif row.state != "live":
            dead = row.state.startswith("dead")
            style = meaning(app, "bad", bold=True) if dead else meaning(app, "warn")
            alerts = Text(row.state, style="dim" if row.state.startswith("ended") else style)
        else:
            alerts = Text("ok", style=meaning(app, "good"))
        grad = row.grad_total
        # Text, never str: a str cell is parsed as markup (a host named "[gpu]" would vanish)
        # on every render and every width measurement.
        plain = [
            str(row.rank),
            row.node,
            "-" if row.step is None else str(row.step),
            _time(row.step_time),
            _time(row.data_time),
            phases,
            fmt_loss(row.loss),
            "-" if grad is None else f"{grad:.4g}",
            "-" if row.memory is None else fmt_bytes(row.memory),
        ]
        return [
            *(Text(cell) for cell in plain),
            _gpu_util(row),
            alerts,
        ]
