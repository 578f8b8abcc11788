"""ActivationTable: per-module output statistics (mean, std, min, max, zeros, non-finite) and
each module's |output| distribution in one line."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from rich.text import Text
from textual.widgets import DataTable

from tdbg.format import fmt, fmt_stat
from tdbg.model.deep import Activations
from tdbg.model.distributions import per_decade
from tdbg.tui.widgets.glyphs import BLOCKS

DEAD = 0.9  # more than this fraction of exact zeros: a dead ReLU (or a dead layer)
STATS = ("mean", "std", "min", "max")
# The distribution column: one glyph per decade of |output| (decade_labels: exact zeros, <1e-8,
# 1e-8 ... 1e2, >=1e3, non-finite: 15), its height the bin's share against the row's fullest
# bin; an empty bin a dot, so that the decades line up from row to row and a shift reads at a
# glance. The header is as wide as the strip.
DIST_HEADER = "|out| by decade"


def distribution_strip(counts: tuple[int, ...] | None) -> str:
    """One character per decade bin (15): ``·`` empty, ``▁``..``█`` by share; "" unknown."""
    if counts is None or sum(counts) <= 0:
        return ""
    shares = per_decade(np.asarray(counts, dtype=np.float64).reshape(-1, 1))[:, 0]
    top = float(shares.max())
    cells = []
    for share in shares:
        if share <= 0:
            cells.append("·")
        else:  # any element at all shows: the lowest block, never a dot
            level = max(1, math.ceil(share / top * len(BLOCKS)))
            cells.append(BLOCKS[level - 1])
    return "".join(cells)


class ActivationTable(DataTable[Any]):
    """Rows are keyed by module index and rebuilt only when the modules change; a new sample
    rewrites the visible rows only (as GradientTable does), so 1,000 modules stay cheap."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "activation-table--dead",
        "activation-table--nonfinite",
        "activation-table--type",
        "activation-table--empty-bin",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", fixed_columns=1, **kwargs)
        self.data: Activations | None = None
        self._names: list[str] = []

    def on_mount(self) -> None:
        # The alarm columns come first: on a narrow screen the module type is what is cut off.
        self.add_column("module", key="module")
        self.add_column("non-fin", key="nonfinite")
        self.add_column("zeros", key="zeros")
        # Where the outputs lie, before the figures that summarise it: at 120x40 the strip
        # stays on screen and max, then min, are what is cut.
        self.add_column(DIST_HEADER, key="distribution")
        for stat in STATS:
            self.add_column(stat, key=stat)
        self.add_column("type", key="type")

    def show(self, data: Activations | None) -> None:
        self.data = data
        names = data.names if data is not None else []
        if names != self._names:
            self._names = list(names)
            self.clear()
            for i in range(len(names)):
                self.add_row(*self._cells(i), key=str(i))
            return
        self._refresh_visible()

    def row_state(self, i: int) -> str | None:
        """``nonfinite`` or ``dead`` for a module's row, else None (tests and styles read this)."""
        data = self.data
        if data is None or i >= len(data.names):
            return None
        nonfinite = float(data.nonfinite[i])
        stats = [float(getattr(data, s)[i]) for s in STATS]
        if (math.isfinite(nonfinite) and nonfinite > 0) or any(math.isnan(v) for v in stats[:2]):
            return "nonfinite"
        zero = float(data.zero_frac[i])
        if math.isfinite(zero) and zero > DEAD:
            return "dead"
        return None

    def _cells(self, i: int) -> list[Text]:
        data = self.data
        assert data is not None
        state = self.row_state(i)
        style = self.get_component_rich_style(f"activation-table--{state}") if state else ""
        name = data.names[i] or "(root model)"
        nonfinite = float(data.nonfinite[i])
        count = int(nonfinite) if math.isfinite(nonfinite) else None
        zero = float(data.zero_frac[i])
        zeros = fmt(zero * 100 if math.isfinite(zero) else None, ".0f", "%")
        cells = [
            Text(name, style=style),
            Text(fmt(count, "d"), justify="right", style=style),
            Text(zeros, justify="right", style=style),
            self._distribution(i, style),
        ]
        for stat in STATS:
            value = fmt_stat(float(getattr(data, stat)[i]))
            cells.append(Text(value, justify="right", style=style))
        type_style = style or self.get_component_rich_style("activation-table--type")
        cells.append(Text(data.types[i], style=type_style))
        return cells

    def _distribution(self, i: int, style: Any) -> Text:
        data = self.data
        assert data is not None
        hist = data.hist[i] if i < len(data.hist) else None
        strip = distribution_strip(hist)
        if not strip:
            return Text("not counted" if data.hist else "", style="italic dim")
        empty = self.get_component_rich_style("activation-table--empty-bin")
        text = Text(no_wrap=True)
        for glyph in strip:
            text.append(glyph, style=empty if glyph == "·" else style)
        return text

    def _refresh_visible(self) -> None:
        if not self._names or self.data is None:
            return
        top = max(0, int(self.scroll_offset.y))
        keys = [column.key for column in self.ordered_columns]
        for row in self.ordered_rows[top : top + max(1, self.size.height)]:
            cells = self._cells(int(str(row.key.value)))
            for key, cell in zip(keys, cells, strict=False):
                self.update_cell(row.key, key, cell)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if int(old_value) != int(new_value):
            self._refresh_visible()
