"""GradientHeatmap: layers x steps on a log colour scale fitted to the data, with its legend."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tdbg.model.names import matching, shorten
from tdbg.tui.widgets.layer_filter import LayerFilter

LEVELS = 24
NONFINITE = -1
ZERO = -2
ABSENT = -3  # no norm: the layer had not come yet, or had left the model (a blank cell)
GLYPHS = {NONFINITE: "×", ZERO: "░", ABSENT: " "}  # not colours alone: they must read on any theme
MIN_LABEL = 12
MIN_DECADES = 1.0  # the scale spans at least this, so noise on a flat layer is not a rainbow
LEGEND_ROWS = 1


def fit_scale(logs: np.ndarray) -> tuple[float, float]:
    """The colour scale's ends (log10 units) for these log10 norms: Tukey's fences (quartiles
    ± 1.5 IQR) within the data's own range, so one vanished or exploded layer does not squash
    every other layer into one colour (it takes the end colour instead), and at least
    MIN_DECADES wide, centred on the data."""
    finite = logs[np.isfinite(logs)]
    if not finite.size:
        return -MIN_DECADES / 2, MIN_DECADES / 2
    q1, q3 = np.percentile(finite, [25, 75])
    lo = max(float(finite.min()), float(q1 - 1.5 * (q3 - q1)))
    hi = min(float(finite.max()), float(q3 + 1.5 * (q3 - q1)))
    if hi - lo < MIN_DECADES:
        mid = (hi + lo) / 2
        lo, hi = mid - MIN_DECADES / 2, mid + MIN_DECADES / 2
    return lo, hi


def bucket_columns(
    rows: np.ndarray, absent: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows (steps x layers) folded into columns, each from its start to the next one's:
    (layers x columns of values, of blanks). A NaN or Inf anywhere in a column's steps is its
    value (never lost between two columns); else the largest norm there (spikes show); a
    column of nothing but absent norms is a blank."""
    data = rows.astype(np.float64)
    real = ~absent
    bad = ~np.isfinite(data) & real
    with np.errstate(all="ignore"):
        largest = np.fmax.reduceat(np.where(real & ~bad, data, np.nan), starts, axis=0)
    nonfinite = np.logical_or.reduceat(bad, starts, axis=0)
    blank = np.logical_and.reduceat(absent, starts, axis=0)
    folded = np.where(nonfinite, np.nan, largest)
    return folded.T, (blank & ~nonfinite).T


def sci(log10: float) -> str:
    """10**log10 in two or three characters of mantissa: ``3e-4``, ``1e2``."""
    mantissa, exponent = f"{10.0**log10:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


class GradientHeatmap(LayerFilter, ScrollView, can_focus=True):
    """Call ``show(names, steps, rows)``; rows is (sampled steps x layers), oldest first.

    The first line is the legend (the colour ramp between the scale's ends, the steps shown,
    what ``×`` and ``░`` mean); it stays put while the layers scroll under it.
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "gradient-heatmap--low",
        "gradient-heatmap--mid",
        "gradient-heatmap--warm",
        "gradient-heatmap--high",
        "gradient-heatmap--nonfinite",
        "gradient-heatmap--zero",
        "gradient-heatmap--label",
    }
    # The app's stylesheet may restyle these; the defaults make the widget whole on its own.
    DEFAULT_CSS = """
    GradientHeatmap > .gradient-heatmap--low { color: $primary; }
    GradientHeatmap > .gradient-heatmap--mid { color: $success; }
    GradientHeatmap > .gradient-heatmap--warm { color: $warning; }
    GradientHeatmap > .gradient-heatmap--high { color: $error; }
    GradientHeatmap > .gradient-heatmap--nonfinite { color: $warning; text-style: bold; }
    GradientHeatmap > .gradient-heatmap--zero { color: $foreground-muted; }
    GradientHeatmap > .gradient-heatmap--label { color: $foreground-muted; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name_filter = ""
        self._names: list[str] = []
        self._rows: list[int] = []  # the layers that pass the filter, in model order
        self._levels = np.zeros((0, 0), dtype=np.int16)
        self._styles: list[Style] = []
        self._special: dict[int, Style] = {}
        self._label = Style()
        self._label_width = MIN_LABEL
        self._scale: tuple[float, float, bool, bool] | None = None  # lo, hi, clipped lo/hi
        self._caption = ""
        self._built_width = -1  # the width the columns were sampled for
        self._data: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None

    def _palette(self) -> None:
        def color(name: str) -> Color:
            style = self.get_component_styles(name)
            return style.color

        # Four stops (blue, green, yellow, red): a straight green-to-red blend passes through a
        # grey that reads like the zero colour.
        stops = [color(f"gradient-heatmap--{n}") for n in ("low", "mid", "warm", "high")]
        styles = []
        for i in range(LEVELS):
            at = i / (LEVELS - 1) * (len(stops) - 1)
            k = min(int(at), len(stops) - 2)
            c = stops[k].blend(stops[k + 1], at - k)
            styles.append(Style(color=c.rich_color))
        self._styles = styles
        self._special = {
            level: self.get_component_rich_style(f"gradient-heatmap--{name}")
            for level, name in ((NONFINITE, "nonfinite"), (ZERO, "zero"))
        }
        self._label = self.get_component_rich_style("gradient-heatmap--label")
        self._special[ABSENT] = self._label

    def show(
        self,
        names: list[str],
        steps: np.ndarray,
        rows: np.ndarray,
        absent: np.ndarray | None = None,
    ) -> None:
        """``rows``: per-layer norms (rows x layers) of ``steps``; ``absent``: the same shape,
        true where a row has no norm for a layer (blank, not a NaN/Inf mark)."""
        if absent is None or absent.shape != rows.shape:
            absent = np.zeros(rows.shape, dtype=bool)
        self._data = (names, steps, rows, absent)
        self._rebuild()

    def on_resize(self) -> None:
        # The heatmap may get its data while hidden (width 0); lay it out once it has a size.
        self._rebuild()

    def _rebuild(self) -> None:
        if self._data is None:
            return
        names, steps, rows, absent = self._data
        self._palette()
        self._names = names
        self._rows = matching(names, self.name_filter)
        region = self.scrollable_content_region.width
        self._built_width = region
        longest = max((len(names[i]) for i in self._rows), default=MIN_LABEL)
        self._label_width = max(MIN_LABEL, min(longest, region // 3))
        width = max(1, region - self._label_width - 1)
        self._scale = None
        if rows.shape[0] == 0 or rows.shape[1] != len(names):
            self._levels = np.zeros((len(self._rows), 0), dtype=np.int16)
            self._caption = "no sampled gradients yet"
        else:
            # One column per run of sampled steps, as many as the width holds.
            cols = np.unique(
                np.linspace(0, rows.shape[0] - 1, min(width, rows.shape[0])).astype(int)
            )
            shown = np.asarray(self._rows, dtype=np.intp)
            data, gaps = bucket_columns(rows[:, shown], absent[:, shown], cols)
            with np.errstate(all="ignore"):
                logs = np.log10(np.where(data > 0, data, np.nan))
            lo, hi = fit_scale(logs)
            finite = logs[np.isfinite(logs)]
            clipped = (
                bool(finite.size and finite.min() < lo),
                bool(finite.size and finite.max() > hi),
            )
            self._scale = (lo, hi, *clipped)
            t = np.clip((logs - lo) / (hi - lo), 0.0, 1.0)
            levels = np.nan_to_num(t * (LEVELS - 1), nan=0.0).astype(np.int16)
            levels[~np.isfinite(data)] = NONFINITE
            levels[data == 0] = ZERO
            levels[gaps] = ABSENT
            self._levels = levels
            self._caption = f"steps {int(steps[cols[0]])}…{int(steps[-1])}"
        self.virtual_size = Size(
            self._label_width + 1 + self._levels.shape[1], len(self._rows) + LEGEND_ROWS
        )
        self.refresh()

    def _legend(self, width: int) -> Strip:
        if self._scale is None:
            return Strip([Segment(self._caption, self._label)]).extend_cell_length(width)
        lo, hi, below, above = self._scale
        low = ("≤" if below else "") + sci(lo) + " "
        high = " " + ("≥" if above else "") + sci(hi)
        caption = f" · {self._caption}"
        marks = [
            (" ", self._label),
            ("×", self._special[NONFINITE]),
            (" NaN/Inf ", self._label),
            ("░", self._special[ZERO]),
            (" zero", self._label),
        ]
        # The ramp takes what the words leave; where they do not fit beside a ramp of 4, the
        # steps shown go first (whole: never cut mid-word), then the marks' words shorten.
        words = len(low) + len(high) + sum(len(text) for text, _ in marks)
        if words + 4 + len(caption) > width:
            caption = ""
        if words + 4 > width:
            marks[2], marks[4] = (" NaN ", self._label), (" 0", self._label)
            words -= 6
        ramp = max(4, min(LEVELS, width - words - len(caption)))
        segments = [Segment(low, self._label)]
        for k in range(ramp):
            segments.append(Segment("█", self._styles[round(k * (LEVELS - 1) / (ramp - 1))]))
        segments.append(Segment(high, self._label))
        segments.extend(Segment(text, style) for text, style in marks)
        if caption:
            segments.append(Segment(caption, self._label))
        return Strip(segments).crop(0, width).extend_cell_length(width)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        if y < LEGEND_ROWS:
            if self._data is not None and width != self._built_width:
                # Built before layout gave it a width (shown while hidden, or a scrollbar came):
                # resample the columns for this width once this frame is drawn.
                self.call_later(self._rebuild)
            return self._legend(width)
        position = y - LEGEND_ROWS + scroll_y
        if position >= len(self._rows):
            return Strip.blank(width)
        name = shorten(self._names[self._rows[position]], self._label_width)
        segments = [Segment(name.ljust(self._label_width) + " ", self._label)]
        row = self._levels[position] if position < self._levels.shape[0] else np.empty(0)
        if row.size:
            # Runs of equal colour become one segment: far fewer segments than cells.
            change = np.flatnonzero(np.diff(row)) + 1
            starts = np.concatenate(([0], change))
            ends = np.concatenate((change, [row.size]))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                level = int(row[s])
                style = self._special[level] if level < 0 else self._styles[level]
                segments.append(Segment(GLYPHS.get(level, "█") * (e - s), style))
        return Strip(segments).crop(scroll_x, scroll_x + width).extend_cell_length(width)

    @property
    def caption(self) -> str:
        """The steps shown (``steps 0…399``), as laid out at the widget's current width."""
        return self._caption
