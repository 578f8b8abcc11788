"""GradientHeatmap: layers x steps, log colour scale; renders only the rows on screen."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

LOG_MIN = -8.0  # 1e-8: vanished
LOG_MID = -2.0
LOG_MAX = 4.0  # 1e4: exploded
LEVELS = 24
NONFINITE = -1
ZERO = -2
LABEL = 18


class GradientHeatmap(ScrollView, can_focus=True):
    """Call ``show(names, steps, rows)``; rows is (sampled steps x layers), oldest first."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "gradient-heatmap--low",
        "gradient-heatmap--mid",
        "gradient-heatmap--high",
        "gradient-heatmap--nonfinite",
        "gradient-heatmap--zero",
        "gradient-heatmap--label",
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._names: list[str] = []
        self._levels = np.zeros((0, 0), dtype=np.int16)
        self._styles: list[Style] = []
        self._special: dict[int, Style] = {}
        self._label = Style()
        self._caption = ""
        self._data: tuple[list[str], np.ndarray, np.ndarray] | None = None

    def _palette(self) -> None:
        def color(name: str) -> Color:
            style = self.get_component_styles(name)
            return style.color

        low, mid, high = (color(f"gradient-heatmap--{n}") for n in ("low", "mid", "high"))
        styles = []
        for i in range(LEVELS):
            t = i / (LEVELS - 1)
            c = low.blend(mid, t * 2) if t <= 0.5 else mid.blend(high, (t - 0.5) * 2)
            styles.append(Style(color=c.rich_color))
        self._styles = styles
        self._special = {
            NONFINITE: Style(color=color("gradient-heatmap--nonfinite").rich_color),
            ZERO: Style(color=color("gradient-heatmap--zero").rich_color),
        }
        self._label = self.get_component_rich_style("gradient-heatmap--label")

    def show(self, names: list[str], steps: np.ndarray, rows: np.ndarray) -> None:
        self._data = (names, steps, rows)
        self._rebuild()

    def on_resize(self) -> None:
        # The heatmap may get its data while hidden (width 0); lay it out once it has a size.
        self._rebuild()

    def _rebuild(self) -> None:
        if self._data is None:
            return
        names, steps, rows = self._data
        self._palette()
        self._names = names
        width = max(1, self.scrollable_content_region.width - LABEL - 1)
        if rows.shape[0] == 0 or rows.shape[1] != len(names):
            self._levels = np.zeros((len(names), 0), dtype=np.int16)
            self._caption = "no sampled gradients yet"
        else:
            cols = np.unique(
                np.linspace(0, rows.shape[0] - 1, min(width, rows.shape[0])).astype(int)
            )
            data = rows[cols].T.astype(np.float64)  # layers x columns
            with np.errstate(all="ignore"):
                logs = np.log10(np.where(data > 0, data, np.nan))
            t = np.clip((logs - LOG_MIN) / (LOG_MAX - LOG_MIN), 0.0, 1.0)
            levels = np.nan_to_num(t * (LEVELS - 1), nan=0.0).astype(np.int16)
            levels[~np.isfinite(data)] = NONFINITE
            levels[data == 0] = ZERO
            self._levels = levels
            self._caption = f"steps {int(steps[cols[0]])}…{int(steps[cols[-1]])}"
        self.virtual_size = Size(LABEL + 1 + self._levels.shape[1], len(names))
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = y + scroll_y
        width = self.scrollable_content_region.width
        if index >= len(self._names):
            return Strip.blank(width)
        name = self._names[index]
        label = (name if len(name) <= LABEL else "…" + name[-(LABEL - 1) :]).ljust(LABEL)
        segments = [Segment(label + " ", self._label)]
        row = self._levels[index] if index < self._levels.shape[0] else np.empty(0, np.int16)
        if row.size:
            # Runs of equal colour become one segment: far fewer segments than cells.
            change = np.flatnonzero(np.diff(row)) + 1
            starts = np.concatenate(([0], change))
            ends = np.concatenate((change, [row.size]))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                level = int(row[s])
                style = self._special.get(level) or self._styles[level]
                glyph = "×" if level == NONFINITE else "█"
                segments.append(Segment(glyph * (e - s), style))
        return Strip(segments).crop(scroll_x, scroll_x + width).extend_cell_length(width)

    @property
    def caption(self) -> str:
        return self._caption
