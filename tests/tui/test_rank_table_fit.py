"""The job screen's rank table leaves out columns by priority rather than scroll sideways."""

from __future__ import annotations

from collections.abc import Callable

from textual.app import App, ComposeResult
from waiting import wait_for

from tdbg.model.job_table import RankRow
from tdbg.tui.widgets.rank_table import COLUMNS, DROP_ORDER, RankTable


def rows(alerts: list[str]) -> list[RankRow]:
    return [
        RankRow(rank, f"node{rank // 8:03d}", 499, 0.5, 0.05, 0.135, 0.248, 0.045, 0.5795,
                1.063, 13 << 30, 87.0, True, alerts if rank == 21 else [], "stalled")
        for rank in (21, 0, 1, 2)
    ]  # fmt: skip


class OneTable(App[None]):
    def compose(self) -> ComposeResult:
        yield RankTable()


def shown_columns(table: RankTable) -> list[str]:
    return [str(column.label) for column in table.ordered_columns]


def fitted_to(table: RankTable, expected: list[str]) -> Callable[[], bool]:
    return lambda: shown_columns(table) == expected


async def test_a_narrow_panel_drops_columns_in_order_and_never_scrolls_sideways() -> None:
    app = OneTable()
    async with app.run_test(size=(200, 12)) as pilot:
        table = app.query_one(RankTable)
        table.show(rows(["straggler", "rank_divergence"]))
        await pilot.pause()
        assert shown_columns(table) == list(COLUMNS)  # wide: every column
        for width, dropped in ((118, 1), (80, 4), (64, 6)):
            await pilot.resize_terminal(width, 12)
            expected = [c for c in COLUMNS if c not in DROP_ORDER[:dropped]]
            await wait_for(pilot, fitted_to(table, expected), f"fitted to {width}")
            await pilot.pause()
            assert not table.show_horizontal_scrollbar, (width, expected)
            assert str(table.get_row("21")[-1]) == "straggler rank_divergence"
        await pilot.resize_terminal(200, 12)  # wide again: every column back, in its place
        await wait_for(pilot, lambda: shown_columns(table) == list(COLUMNS), "every column")
        assert [str(c) for c in table.get_row_at(0)][:2] == ["21", "node002"]


async def test_columns_come_back_when_a_long_alert_goes() -> None:
    # A column is widened for a wider cell and never narrowed in place: a long alert that has
    # gone must not keep the columns it pushed out away.
    app = OneTable()
    async with app.run_test(size=(118, 12)) as pilot:
        table = app.query_one(RankTable)
        table.show(rows(["straggler", "rank_divergence", "nonfinite_ranks"]))
        await pilot.pause()
        assert shown_columns(table) == [c for c in COLUMNS if c not in DROP_ORDER[:3]]
        table.show(rows(["straggler"]))
        await pilot.pause()
        assert shown_columns(table) == list(COLUMNS)
        assert not table.show_horizontal_scrollbar
