"""FastCells: a DataTable whose one-line text cells are drawn straight to segments and kept."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey, RowKey

MAX_KEPT = 20_000  # drawn cells kept: a 1,000-layer table's rows several times over


def _same(a: Text, b: Text) -> bool:
    """Whether two Texts draw the same (rich's Text equality leaves the base style out)."""
    return (
        a.plain == b.plain
        and a.spans == b.spans
        and str(a.style) == str(b.style)
        and a.justify == b.justify
    )


class FastCells(DataTable[Any]):
    """DataTable draws every cell through Rich's console (a Padding in a Styled: ~40 µs a cell)
    and keys its cache of drawn cells on a counter that any cell's update moves, so one new
    gradient norm redrew the whole table, names and headings included: ~40 ms a grad update at
    120x40 (benchmarks/README.md, tui.py). Here a cell is kept until the value stored in it is
    replaced (or its place, width or style changes), and a one-line Text that fits is drawn to
    the same segments directly. Anything else (wrapping, justified or cut text, other
    renderables, row labels) is drawn by DataTable as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # key -> (the value drawn: the cell's identity, its lines)
        self._kept: dict[tuple[Any, ...], tuple[object, list[list[Segment]]]] = {}

    def write(self, row_key: Any, column_key: Any, value: Text) -> bool:
        """``update_cell`` unless the cell already draws the same: each write moves the table's
        update counter, which empties DataTable's row and line caches and repaints it all, so
        the rows rewritten at each tick with the same figures were drawn again for nothing.
        True when the cell changed."""
        old = self._data.get(RowKey(row_key) if isinstance(row_key, str) else row_key, {}).get(
            ColumnKey(column_key) if isinstance(column_key, str) else column_key
        )
        if isinstance(old, Text) and _same(old, value):
            return False
        self.update_cell(row_key, column_key, value)
        return True

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._kept.clear()

    def _clear_caches(self) -> None:
        super()._clear_caches()
        self._kept.clear()

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style: Style,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ) -> list[list[Segment]]:
        header = row_index == -1
        if column_index < 0:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._header_row_key if header else self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        if row_key is None or column_key is None:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        if header:
            value: object = self.columns[column_key].label
            height = self.header_height
        else:
            row = self.rows[row_key]
            value = self._data[row_key][column_key]
            height = 0 if row.auto_height else row.height
        place = (row_key, column_key, row_index, column_index, width)
        key = (*place, base_style, cursor, hover, self._show_hover_cursor, self._pseudo_class_state)
        kept = self._kept.get(key)
        if kept is not None and kept[0] is value:
            return kept[1]
        lines = None
        if height == 1 and isinstance(value, Text):
            where = (row_index, column_index)
            lines = self._draw_line(value, *where, base_style, width, cursor, hover)
        if lines is None:
            lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (value, lines)
        return lines

    def _draw_line(
        self,
        text: Text,
        row_index: int,
        column_index: int,
        base_style: Style,
        width: int,
        cursor: bool,
        hover: bool,
    ) -> list[list[Segment]] | None:
        """The segments DataTable's Rich path draws for a one-line Text that fits its cell; None
        for any other (the Rich path draws it)."""
        pad = self.cell_padding
        inner = width - 2 * pad
        plain = text.plain
        if (
            inner < 0
            or text.justify not in (None, "default", "left")
            or "\n" in plain
            or "\t" in plain
            or cell_len(plain) > inner
        ):
            return None
        header = row_index == -1
        fixed = not header and (row_index < self.fixed_rows or column_index < self.fixed_columns)
        component, post = self._get_styles_to_render_cell(
            header,
            False,
            fixed,
            hover,
            cursor,
            self.show_cursor,
            self._show_hover_cursor,
            self.cursor_foreground_priority == "css",
            self.cursor_background_priority == "css",
        )
        pre = base_style + Style.from_meta({"row": row_index, "column": column_index}) + component
        console = self.app.console
        null = Style.null()
        segments = [Segment(" " * pad, null)] if pad else []
        if text.spans:
            segments.extend(text.render(console, end=""))
        elif plain:  # Text.render leaves a text without spans unstyled: Rich's join styles it
            segments.append(Segment(plain, console.get_style(text.style, default=null)))
        room = inner - cell_len(plain)
        if room:
            segments.append(Segment(" " * room, null))
        if pad:
            segments.append(Segment(" " * pad, null))
        return [list(Segment.apply_style(segments, pre, post))]
