"""FastCells draws what DataTable draws, and redraws a cell only when its value is replaced."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widgets import DataTable

from tdbg.tui.widgets.fast_cells import FastCells


def _base_and_span() -> Text:
    text = Text("base and span", style="blue")
    text.stylize("underline", 0, 4)
    return text


CELLS: list[Any] = [
    Text("plain"),
    Text("styled", style="bold red"),
    Text.assemble(("two ", "green"), ("spans", "italic")),
    _base_and_span(),
    Text("right", justify="right"),
    Text("much too long for its column", style="yellow"),
    "[b]markup[/b] str",
    Text(""),
]


def _fill(table: DataTable[Any], offset: int = 0) -> None:
    table.add_column("name", width=10)
    table.add_column(Text("figure", style="bold"), width=14)
    for i in range(len(CELLS)):
        table.add_row(CELLS[(i + offset) % len(CELLS)], CELLS[i], key=str(i))


class Pair(App[None]):
    CSS = "DataTable { height: 12; width: 32; }"

    def compose(self) -> ComposeResult:
        yield DataTable(id="plain")
        yield FastCells(id="fast")

    def on_mount(self) -> None:
        for table in self.query(DataTable):
            _fill(table, offset=3)


def _lines(table: DataTable[Any]) -> list[list[tuple[str, Any]]]:
    """Each line's characters with their styles: what the terminal shows, however split."""
    table._styles_cache.clear()
    strips = table.render_lines(Region(0, 0, table.size.width, table.size.height))
    return [[(c, s.style) for s in strip for c in s.text] for strip in strips]


async def test_fast_cells_draw_what_datatable_draws() -> None:
    app = Pair()
    async with app.run_test(size=(70, 14)) as pilot:
        plain, fast = app.query_one("#plain", DataTable), app.query_one("#fast", FastCells)
        await pilot.pause()
        app.set_focus(None)
        await pilot.pause()
        assert _lines(fast) == _lines(plain)
        # Focused, the cursor on another row, a cell replaced: still the same picture.
        for table in (plain, fast):
            table.move_cursor(row=3)
            table.update_cell("2", table.ordered_columns[1].key, Text("new", style="magenta"))
        pictures = []
        for table in (plain, fast):
            table.focus()
            await pilot.pause()
            pictures.append(_lines(table))
        assert pictures[0] == pictures[1]


async def test_a_cell_is_drawn_again_only_when_its_value_is_replaced() -> None:
    app = Pair()
    async with app.run_test(size=(70, 14)) as pilot:
        fast = app.query_one("#fast", FastCells)
        await pilot.pause()
        _lines(fast)
        drawn: list[tuple[int, int]] = []
        original = fast._draw_line

        def counting(text: Text, row: int, column: int, *rest: Any) -> Any:
            drawn.append((row, column))
            return original(text, row, column, *rest)

        fast._draw_line = counting  # type: ignore[method-assign,assignment]
        fast.update_cell("0", fast.ordered_columns[1].key, Text("fresh"))
        _lines(fast)
        assert drawn == [(0, 1)], drawn


async def test_write_leaves_a_cell_that_draws_the_same_alone() -> None:
    app = Pair()
    async with app.run_test() as pilot:
        await pilot.pause()
        table = app.query_one(FastCells)
        before = table._update_count
        # The same words and styles in a new Text: nothing to redraw, the caches stay.
        assert not table.write("1", table.ordered_columns[1].key, Text("styled", style="bold red"))
        assert table._update_count == before
        # Another base style (rich's Text equality leaves it out) is a change.
        assert table.write("1", table.ordered_columns[1].key, Text("styled", style="bold blue"))
        assert table._update_count == before + 1
        assert str(table.get_cell("1", table.ordered_columns[1].key)) == "styled"
        assert table.get_cell("1", table.ordered_columns[1].key).style == "bold blue"
