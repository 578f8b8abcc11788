"""ProfilerTable: a profile's top ops, sortable by any column, with a Δ against the previous one."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from rich.text import Text
from textual.message import Message
from textual.widgets import DataTable

from tdbg.format import fmt, fmt_bytes, fmt_us
from tdbg.model.deep import TIME_COLUMNS
from tdbg.protocol.messages.results import ProfileResult
from tdbg.protocol.messages.results import ProfileRow as OpRow

# Op names are long (autograd::engine::evaluate_function: ...): cut to what the panel leaves
# beside the figures (NAME_WIDTH until the table is laid out, never below MIN_NAME): the full
# name is in the trace.
NAME_WIDTH = 34
MIN_NAME = 20
COLUMNS = (
    ("name", "op"),
    ("calls", "calls"),
    ("self_cpu", "self CPU"),
    ("cpu_total", "CPU total"),
    ("self_device", "self dev"),
    ("device_total", "dev total"),
    ("cpu_memory", "CPU mem"),
    ("device_memory", "dev mem"),
    ("share", "share"),
)
DEVICE_COLUMNS = frozenset({"self_device", "device_total", "device_memory"})
COMPARE_COLUMNS = (("prev", "prev/call"), ("delta", "Δ/call"))
TITLES = dict(COLUMNS + COMPARE_COLUMNS)
SLOWER = 0.10  # a per-call change above +10 % marks an op as slower (and below -10 % faster)


def per_call_change(now: OpRow, before: OpRow | None, metric: str) -> float | None:
    """Relative change of ``metric`` per call: +0.35 = 35 % slower per call than before."""
    if before is None:
        return None
    a, b = now.per_call(metric), before.per_call(metric)
    if a is None or b is None or not b > 0:
        return None
    return a / b - 1


class ProfilerTable(DataTable[Any]):
    """Rows are rebuilt on a new profile or a new sort (at most 100 rows: cheap)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "profiler-table--slower",
        "profiler-table--faster",
        "profiler-table--new",
        "profiler-table--dim",
        "profiler-table--share",
    }

    class Sorted(Message):
        """The user picked another sort column (key or header click)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", fixed_columns=1, **kwargs)
        self.sort_column: str | None = None  # None: the profile's own default sort
        self.descending = True
        self.profile: ProfileResult | None = None
        self.previous: ProfileResult | None = None
        self._shown: tuple[Any, ...] = ()
        self._previous_rows: dict[str, OpRow] = {}
        self._name_width = NAME_WIDTH

    # --- what is shown --------------------------------------------------------------------

    @property
    def device(self) -> bool:
        """Device columns are shown only for profiles of a device run: on a CPU-only run they
        could only ever read n/a, and the width they take is what the comparison needs."""
        return any(p is not None and p.device for p in (self.profile, self.previous))

    @property
    def columns_shown(self) -> list[str]:
        keys = [key for key, _ in COLUMNS if self.device or key not in DEVICE_COLUMNS]
        if self.previous is not None:
            keys += [key for key, _ in COMPARE_COLUMNS]
        return keys

    @property
    def sort_key(self) -> str:
        if self.sort_column in self.columns_shown:
            return self.sort_column or "cpu_total"
        return self.profile.sort if self.profile is not None else "cpu_total"

    @property
    def metric(self) -> str:
        """The time column compared against the previous profile (per call)."""
        if self.sort_column in TIME_COLUMNS:
            return str(self.sort_column)
        return self.profile.sort if self.profile is not None else "cpu_total"

    def sort_caption(self) -> str:
        arrow = "↓" if self.descending else "↑"
        return f"sort {TITLES.get(self.sort_key, self.sort_key)} {arrow}"

    def show(self, profile: ProfileResult | None, previous: ProfileResult | None) -> None:
        """Show ``profile``; with ``previous``, add its per-call value and the change."""
        if previous is profile:
            previous = None
        self.profile, self.previous = profile, previous
        self._rebuild()

    def cycle_sort(self, step: int = 1) -> str:
        keys = self.columns_shown
        here = keys.index(self.sort_key) if self.sort_key in keys else 0
        self.sort_column = keys[(here + step) % len(keys)]
        self.descending = self.sort_column != "name"
        self._rebuild()
        self.post_message(self.Sorted())
        return self.sort_key

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        column = str(event.column_key.value)
        if column == self.sort_key:
            self.descending = not self.descending  # a second click reverses
        else:
            self.sort_column = column
            self.descending = column != "name"
        self._rebuild()
        self.post_message(self.Sorted())

    def on_resize(self) -> None:
        self._fit_names()

    def _fit_names(self) -> None:
        """Give the op names what the other columns leave of the panel's width: a wide
        screen shows them whole instead of cut beside empty space."""
        avail = self.scrollable_content_region.width
        if not avail or self.profile is None:
            return
        others = sum(
            column.get_render_width(self)
            for key, column in self.columns.items()
            if key.value != "name"
        )
        width = max(MIN_NAME, avail - others - 2 * self.cell_padding)
        if width != self._name_width:
            self._name_width = width
            self._shown = ()  # the same profile, rebuilt at the new width
            self._rebuild()

    # --- building -------------------------------------------------------------------------

    def _sort_value(self, row: OpRow, key: str) -> float | str | None:
        profile = self.profile
        assert profile is not None
        if key == "name":
            return row.name
        if key == "share":
            return profile.share(row)
        if key == "prev":
            before = self._before(row)
            return before.per_call(self.metric) if before is not None else None
        if key == "delta":
            return per_call_change(row, self._before(row), self.metric)
        return row.value(key)

    def _before(self, row: OpRow) -> OpRow | None:
        return self._previous_rows.get(row.name)

    def _ordered(self) -> list[OpRow]:
        assert self.profile is not None
        key = self.sort_key
        rows = list(self.profile.rows)
        if key == "name":
            return sorted(rows, key=lambda r: r.name, reverse=self.descending)
        present: list[tuple[float, OpRow]] = []
        missing: list[OpRow] = []
        for row in rows:
            value = self._sort_value(row, key)
            if isinstance(value, float) and math.isfinite(value):
                present.append((value, row))
            else:
                missing.append(row)
        present.sort(key=lambda pair: pair[0], reverse=self.descending)
        return [row for _, row in present] + missing  # n/a rows last either way

    def _rebuild(self) -> None:
        profile, previous = self.profile, self.previous
        shown = (
            self.device,
            id(profile),  # kept results are frozen: the same object is the same profile
            id(previous),
            self.sort_key,
            self.descending,
            self.metric,
        )
        if shown == self._shown:
            return
        self._shown = shown
        self._previous_rows = {r.name: r for r in previous.rows} if previous else {}
        self.clear(columns=True)
        if profile is None:
            return
        for key in self.columns_shown:
            title = TITLES[key]
            if key == self.sort_key:
                title += " ↓" if self.descending else " ↑"
            self.add_column(title, key=key)
        for i, row in enumerate(self._ordered()):
            self.add_row(*self._cells(row), key=f"{i}:{row.name}")
        self._fit_names()  # at most one more build: the other columns' widths stay

    def _cells(self, row: OpRow) -> list[Text]:
        profile = self.profile
        assert profile is not None
        dim = self.get_component_rich_style("profiler-table--dim")

        def num(text: str) -> Text:
            return Text(text, justify="right", style=dim if text == "n/a" else "")

        width = self._name_width
        name = row.name if len(row.name) <= width else row.name[: width - 1] + "…"
        device = profile.device
        cells = [Text(name), num(fmt(row.calls, "d")), num(fmt_us(row.self_cpu))]
        cells.append(num(fmt_us(row.cpu_total)))
        if self.device:
            cells.append(num(fmt_us(row.self_device) if device else "n/a"))
            cells.append(num(fmt_us(row.device_total) if device else "n/a"))
        cells.append(num(fmt_bytes(row.cpu_memory)))
        if self.device:
            cells.append(num(fmt_bytes(row.device_memory) if device else "n/a"))
        share = profile.share(row)
        cells.append(
            Text(
                fmt(None if share is None else share * 100, ".1f", "%"),
                justify="right",
                style=self.get_component_rich_style("profiler-table--share"),
            )
        )
        if self.previous is not None:
            before = self._before(row)
            prev = before.per_call(self.metric) if before is not None else None
            cells.append(num(fmt_us(prev) if before is not None else "—"))
            cells.append(self._delta_cell(row, before))
        return cells

    def _delta_cell(self, row: OpRow, before: OpRow | None) -> Text:
        if before is None:
            new = self.get_component_rich_style("profiler-table--new")
            return Text("new", justify="right", style=new)
        change = per_call_change(row, before, self.metric)
        if change is None:
            return Text(
                "n/a", justify="right", style=self.get_component_rich_style("profiler-table--dim")
            )
        style: Any = ""
        if change > SLOWER:
            style = self.get_component_rich_style("profiler-table--slower")
        elif change < -SLOWER:
            style = self.get_component_rich_style("profiler-table--faster")
        mark = " ▲" if change > SLOWER else (" ▼" if change < -SLOWER else "  ")
        return Text(f"{change * 100:+.0f}%{mark}", justify="right", style=style)

    def slower_ops(self) -> list[str]:
        """Names of the ops that got slower per call than in the previous profile (for captions)."""
        if self.profile is None or self.previous is None:
            return []
        out = []
        for row in self.profile.rows:
            change = per_call_change(row, self._before(row), self.metric)
            if change is not None and change > SLOWER:
                out.append(row.name)
        return out
