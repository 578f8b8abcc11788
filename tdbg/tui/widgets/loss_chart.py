"""LossChart: the loss, raw and smoothed, over a window of steps that the keys move, in braille."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.content import Content
from textual.message import Message
from textual.strip import Strip
from textual.visual import Visual

from tdbg.format import fmt
from tdbg.model.chart_axes import (
    StepWindow,
    first_nonfinite,
    log_ticks,
    step_label,
    step_ticks,
    value_label,
    value_ticks,
    y_range,
)
from tdbg.tui.colours import meaning, meaning_rgb
from tdbg.tui.widgets.braille_chart import Axes, Chart, Series, draw
from tdbg.tui.widgets.fit import Part, fit_parts
from tdbg.tui.widgets.steady import SteadyStatic
from tdbg.tui.widgets.tab_stop import take_panel_tab_stop

DEFAULT_WINDOW = 500  # steps shown when w first narrows the chart from the whole run
RAW_DIM = 0.6  # the raw loss is drawn at this share of its colour: the smoothed line leads
TICK_EVERY = 10  # columns per x tick at most
ROWS_PER_TICK = 2  # rows per y tick at most
CURSOR_RGB = (240, 200, 60)  # the inspect cursor's line: apart from every series' colour
SMOOTH_STEPS = 20  # the step-time view's smoothed line: a trailing mean of this many steps
RATE_STEPS = 20  # steps whose step times give the caption's steps/s


def trailing_mean(values: np.ndarray, n: int) -> np.ndarray:
    """The mean of each value and the ``n - 1`` before it (fewer at the start), NaN skipped."""
    ok = np.isfinite(values)
    sums = np.cumsum(np.where(ok, values, 0.0))
    counts = np.cumsum(ok)
    lagged_sums = np.concatenate([np.zeros(n), sums[:-n]]) if len(values) > n else 0.0
    lagged_counts = np.concatenate([np.zeros(n), counts[:-n]]) if len(values) > n else 0
    window = counts - lagged_counts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(window > 0, (sums - lagged_sums) / window, np.nan)


def bucket_mean(x: np.ndarray, y: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Downsample to at most ``buckets`` points (mean per bucket), skipping non-finite values.

    Plotting cost stays fixed however long the run: the chart is redrawn several times a second.
    """
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(y) <= buckets:
        return x, y
    edges = np.linspace(0, len(y), buckets + 1).astype(np.int64)
    sums = np.add.reduceat(y, edges[:-1])
    counts = np.diff(edges)
    return x[edges[:-1]], sums / counts


# Colours of the metrics drawn over the loss (val_loss, loss/NAME, ...), in legend order.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (80, 200, 120),
    (220, 120, 220),
    (235, 235, 235),
    (230, 160, 60),
    (200, 200, 90),
    (240, 110, 110),
)

Extra = tuple[np.ndarray, np.ndarray, tuple[int, int, int]]


@dataclass(slots=True)
class _Data:
    """What the last ``replot`` got: kept so a key redraws at once, without waiting for data."""

    steps: np.ndarray
    loss: np.ndarray
    smoothed: np.ndarray
    extra: Sequence[Extra]
    present: np.ndarray | None
    step_time: np.ndarray | None
    fitted: Sequence[Extra] = ()  # other runs drawn under the loss: the y-range takes them in


class LossChart(SteadyStatic, can_focus=True):
    """Call ``replot(steps, loss, smoothed)``; colours come from the component classes.

    Focused, its keys choose the steps shown (window, zoom, pan) and the y-range (robust or
    full); a caption line above the plot says what is shown and where the loss went NaN. Each
    chart it shows (the loss, the step time, each metric) keeps its own linear / log y-axis;
    with the inspect cursor on, a line marks the cursor's step and the caption its values.
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {"loss-chart--raw", "loss-chart--smoothed"}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("w", "window", "Last N / all", show=False),
        Binding("plus,equals_sign", "zoom(0.5)", "Zoom in", key_display="+", show=False),
        Binding("minus", "zoom(2)", "Zoom out", key_display="-", show=False),
        Binding("comma,left", "pan(-1)", "Older", key_display=",", show=False),
        Binding("full_stop,right", "pan(1)", "Newer", key_display=".", show=False),
        Binding("f", "full_range", "Full y-range", show=False),
        Binding("v", "view", "Loss / step time", show=False),
    ]
    DEFAULT_CSS = """
    LossChart:focus { background: $boost; }
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = StepWindow()
        self.full_range = False
        self.step_times = False  # v: the step time per step instead of the loss
        self.nan_step: int | None = None
        self.logs: set[str] = set()  # the charts (see ``chart_key``) drawn on a log y-axis
        self.series_name = "loss"  # what replot was last given: the loss or a metric's name
        self.cursor: int | None = None  # the inspect cursor's step, while it is on
        self._data: _Data | None = None
        # The caption and the plot drawn straight to the widget's lines (None: a message is
        # shown the Static's way), and what they show: an unchanged draw costs no repaint.
        self._lines: list[Strip] | None = None
        self._shown: object = None
        self._colours: dict[str, tuple[int, int, int]] = {}

    def on_mount(self) -> None:
        take_panel_tab_stop(self)

    # --- colours ---------------------------------------------------------------------------

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._colours.clear()  # a theme or palette change: the components' colours again
        if self._lines is not None:  # drawn in the old colours: draw again, data or none
            self.call_later(self._draw)

    def _rgb(self, component: str) -> tuple[int, int, int]:
        # Asked at every draw; reading a component's style walks the stylesheet (~0.2 ms).
        rgb = self._colours.get(component)
        if rgb is None:
            rgb = self._colours[component] = self._component_rgb(component)
        return rgb

    def _component_rgb(self, component: str) -> tuple[int, int, int]:
        color = self.get_component_rich_style(component).color
        if color is None:
            r, g, b = (200, 200, 200)
        else:
            r, g, b = color.get_truecolor()
        if component == "loss-chart--raw":  # dimmed: raw points are the noise behind the line
            r, g, b = (round(c * RAW_DIM) for c in (r, g, b))
        return (r, g, b)

    def color_style(self, component: str) -> str:
        """A component's colour as a Rich style string (for a legend beside the chart)."""
        r, g, b = self._rgb(component)
        return f"rgb({r},{g},{b})"

    # --- keys ------------------------------------------------------------------------------

    def _span(self) -> tuple[int, int] | None:
        if self._data is None or not len(self._data.steps):
            return None
        return int(self._data.steps[0]), int(self._data.steps[-1])

    def action_window(self) -> None:
        span = self._span()
        if self.window.size is not None or span is None:
            self.window = StepWindow()
        else:
            self.window = StepWindow(DEFAULT_WINDOW).zoomed(1, *span)
        self._draw()
        self.post_message(self.Changed())

    def action_zoom(self, factor: float) -> None:
        span = self._span()
        if span is not None:
            self.window = self.window.zoomed(factor, *span)
            self._draw()
            self.post_message(self.Changed())

    def action_pan(self, direction: int) -> None:
        span = self._span()
        if span is not None:
            self.window = self.window.panned(direction, *span)
            self._draw()

    @property
    def chart_key(self) -> str:
        """Which chart is on show, as the log choices and the settings name it: ``loss``,
        ``step time`` or ``metric:NAME``."""
        if self._showing_step_times():
            return "step time"
        return "loss" if self.series_name == "loss" else f"metric:{self.series_name}"

    @property
    def log_y(self) -> bool:
        return self.chart_key in self.logs

    def toggle_log(self) -> bool:
        """Linear / log y for the chart on show (the others keep theirs); the new choice."""
        self.logs ^= {self.chart_key}
        self._draw()
        self.post_message(self.Changed())
        return self.log_y

    def set_cursor(self, step: int | None, draw: bool = True) -> None:
        """Mark ``step`` (None: no cursor), moving the window to it if it lies outside;
        ``draw=False`` when a replot follows (one plot per paint)."""
        self.cursor = step
        span = self._span()
        if step is not None and span is not None and self.window.size is not None:
            lo, hi = self.window.bounds(*span)
            if not lo <= step <= hi:
                size = self.window.size
                offset = span[1] - step - size // 2
                room = max(0, span[1] - span[0] - size)
                self.window = StepWindow(size, min(max(0, offset), room))
        if draw:
            self._draw()

    def cursor_stride(self) -> int:
        """Steps per braille dot across the steps shown: one press of an arrow moves one dot."""
        span = self._span()
        if span is None:
            return 1
        lo, hi = self.window.bounds(*span)
        return max(1, round((hi - lo) / max(1, 2 * self.content_size.width)))

    def action_full_range(self) -> None:
        self.full_range = not self.full_range
        self._draw()
        self.post_message(self.Changed())

    class Changed(Message):
        """A key changed what the chart shows (window, range, view, scale): the panel's line
        says the scale, and the settings keep the choice."""

    def action_view(self) -> None:
        self.step_times = not self.step_times
        self._draw()
        self.post_message(self.Changed())

    # --- drawing ---------------------------------------------------------------------------

    def replot(
        self,
        steps: np.ndarray,
        loss: np.ndarray,
        smoothed: np.ndarray,
        extra: Sequence[Extra] = (),
        present: np.ndarray | None = None,
        step_time: np.ndarray | None = None,
        fitted: Sequence[Extra] = (),
        name: str = "loss",
    ) -> None:
        """Draw the loss (raw and smoothed) and ``extra`` series ``(steps, values, rgb)``:
        metrics that belong with the loss (val_loss, loss/NAME) on the same axes. ``present``
        marks the steps that reported a loss (a NaN elsewhere is a missing value); with
        ``step_time`` (seconds, per step) v shows it instead of the loss. ``fitted``: series
        drawn like ``extra`` whose values the y-range takes in (another run compared with
        this one: its curve must not leave the chart where it parts from this one's). ``name``:
        what ``loss`` is (a metric charted in its place keeps its own log choice)."""
        self.series_name = name
        self._data = _Data(steps, loss, smoothed, extra, present, step_time, fitted)
        self._draw()

    def caption(self) -> Text:
        """The line above the plot: where the loss went NaN, the cursor's values, the steps
        shown, the y-range mode and the keys; the least needed parts go first when narrow."""
        parts: list[Part] = []
        if self.nan_step is not None:
            bad = meaning(self.app, "bad")
            badge = Text(f" NaN at step {self.nan_step} ", f"bold white on {bad}")
            parts.append((badge, 0))
            parts.append((" ", 0))
        if self._showing_step_times():  # first: the words on the panel say "Loss"
            parts.append((Text("step time ms", "bold"), 0))
            rate = self._recent_rate()
            if rate is not None:
                parts.append((Text(f", now {rate:.3g} steps/s", "bold"), 3))
            parts.append((Text(" · ", "dim"), 0))
        cursor = self.cursor_values()
        if cursor is not None:
            step, values = cursor
            parts.append((Text(f"▏step {step}", "bold"), 0))
            for k, (label, value) in enumerate(values):
                parts.append((Text(f" {label} {fmt(value, '.4g')}"), 0 if k == 0 else 2))
            parts.append((Text(" · ", "dim"), 0))
        span = self._span()
        if span is not None:
            lo, hi = self.window.bounds(*span)
            if self.window.size is None:
                parts.append((Text("all ", "dim"), 5))
                parts.append((Text(f"steps {lo}–{hi}", "dim"), 1))
            else:
                parts.append((Text(f"steps {lo}–{hi}", "dim"), 1))
                if self.window.offset == 0:
                    parts.append((Text(" (newest)", "dim"), 2))
            parts.append((Text(" · y " + ("full" if self.full_range else "fitted"), "dim"), 4))
            if self.log_y:
                parts.append((Text(" · log", "dim"), 1))
            if self.has_focus:
                parts.append((Text(" · keys w + - , . f v l", "dim"), 3))
        elif parts and str(parts[-1][0]) == " · ":
            parts.pop()
        return fit_parts(parts, max(1, self.content_size.width))

    def cursor_values(self) -> tuple[int, list[tuple[str, float | None]]] | None:
        """The cursor's step (the nearest one drawn at or before it) and the values the chart
        shows there: the loss and its smoothed line, a metric, or the step time."""
        data = self._data
        if self.cursor is None or data is None or not len(data.steps):
            return None
        i = int(np.searchsorted(data.steps, self.cursor, side="right")) - 1
        if i < 0:
            return self.cursor, []
        raw, smooth = self._series(data)

        def at(values: np.ndarray) -> float | None:
            return float(values[i]) if i < len(values) else None

        if self._showing_step_times():
            return int(data.steps[i]), [("ms", at(raw)), ("smoothed", at(smooth))]
        if self.series_name != "loss":
            return int(data.steps[i]), [(self.series_name, at(raw))]
        return int(data.steps[i]), [("loss", at(raw)), ("smoothed", at(smooth))]

    def _showing_step_times(self) -> bool:
        data = self._data
        return self.step_times and data is not None and data.step_time is not None

    def _recent_rate(self) -> float | None:
        """Steps per second over the newest steps' own step times (the header's rate is the
        wall clock's; this is what the chart shows)."""
        data = self._data
        if data is None or data.step_time is None:
            return None
        recent = data.step_time[-RATE_STEPS:]
        recent = recent[np.isfinite(recent) & (recent > 0)]
        return float(1.0 / recent.mean()) if recent.size else None

    def _series(self, data: _Data) -> tuple[np.ndarray, np.ndarray]:
        """The raw and smoothed values the chart draws: the loss, or the step time in ms."""
        if not self._showing_step_times():
            return data.loss, data.smoothed
        assert data.step_time is not None
        ms = data.step_time * 1000.0
        return ms, trailing_mean(ms, SMOOTH_STEPS)

    def _draw(self) -> None:
        width, height = self.content_size
        data = self._data
        if data is None or width < 10:
            return
        if height < 5:  # no room for a plot: say so, never leave a bigger size's plot cut off
            self._say(Text.assemble(self.caption(), "\n", "too short to plot (z: zoom)"))
            return
        self.nan_step = first_nonfinite(data.steps, data.loss, data.present)
        x = data.steps.astype(np.float64)
        y, ys = self._series(data)
        extra = () if self._showing_step_times() else (*data.extra, *data.fitted)
        fitted = () if self._showing_step_times() else data.fitted
        log = self.log_y
        if log:
            y = np.where(y > 0, y, np.nan)
            ys = np.where(ys > 0, ys, np.nan)
        if not np.isfinite(y).any():
            if not len(data.steps):
                waiting = "waiting for the first step…"
            elif (
                data.present is not None
                and not data.present.any()
                and not self._showing_step_times()
            ):
                # Not a NaN: the loop passes none (tdbg run of a loop without backward()).
                waiting = "no loss reported by the steps so far (v: step time)"
            else:
                waiting = "no finite loss yet"
            self._say(Text.assemble(self.caption(), "\n", waiting))
            return
        span = self._span()
        assert span is not None
        lo, hi = self.window.bounds(*span)
        inside = (data.steps >= lo) & (data.steps <= hi)
        x, y, ys = x[inside], y[inside], ys[inside] if len(ys) == len(inside) else ys
        points = max(8, 2 * width)  # braille: two dots per cell across
        # The range fits the points as drawn (a bucket's mean, not its lowest raw value): the
        # plot's top and bottom rows then hold the curve, not empty space.
        fit = [bucket_mean(x, y, points)[1]]
        for fx, fy, _ in fitted:
            fit.append(fy[(fx >= lo) & (fx <= hi)])
        fit_y = np.concatenate(fit) if len(fit) > 1 else fit[0]
        if log:
            fit_y = np.where(fit_y > 0, fit_y, np.nan)
        limits = y_range(fit_y, robust=not self.full_range, log=log, rows=max(1, height - 3))
        if limits is None:  # nothing finite among the steps shown
            self._say(Text.assemble(self.caption(), "\n", "no finite value in these steps"))
            return
        xr, yr = bucket_mean(x, y, points)
        series = [Series(xr, yr, self._rgb("loss-chart--raw"))]
        for ex, ey, rgb in extra:
            keep = (ex >= lo) & (ex <= hi)
            ey = ey[keep]
            ey = np.where(ey > 0, ey, np.nan) if log else ey
            series.append(Series(*bucket_mean(ex[keep].astype(np.float64), ey, points), rgb))
        # Drawn last, joined into a line: on top of the raw points.
        xs, yss = bucket_mean(x, ys, points)
        series.append(Series(xs, yss, self._rgb("loss-chart--smoothed"), line=True))
        markers = []
        if self.nan_step is not None:
            markers.append((float(self.nan_step), meaning_rgb(self.app, "bad")))
        if self.cursor is not None:
            markers.append((float(self.cursor), CURSOR_RGB))
        ticks = step_ticks(lo, hi, max(2, width // TICK_EVERY))
        most = max(2, (height - 3) // ROWS_PER_TICK)
        values = log_ticks(*limits, most) if log else value_ticks(*limits, most)
        axes = Axes(
            x_lim=(lo, max(hi, lo + 1)),
            y_lim=limits,
            log=log,
            x_ticks=[(t, step_label(t)) for t in ticks],
            y_ticks=[(v, value_label(v)) for v in values],
        )
        self._show(self.caption(), draw(width, height - 1, axes, series, markers))

    def _say(self, message: Text) -> None:
        """Show a message instead of a plot, the Static's way."""
        if self._lines is not None:
            self._lines = self._shown = None
            self._steady_key = None  # the Static's content is stale: replace it whatever it is
        self.update(message)

    def _show(self, caption: Text, chart: Chart) -> None:
        """Show ``caption`` over ``chart``, drawn to the widget's lines; nothing when both are
        what is shown already."""
        base = self.visual_style
        shown = (caption.plain, tuple(caption.spans), chart, base, self.content_size.width)
        if self._lines is not None and shown == self._shown:
            return
        # The caption, one line with few styles, is drawn the Static's way: its colours and
        # the theme's are then exactly the other panels'.
        top = Visual.to_strips(
            self, Content.from_rich_text(caption), self.content_size.width, 1, base
        )
        head = top[0] if top else Strip.blank(self.content_size.width, base.rich_style)
        self._lines = [head, *chart.strips(base.rich_style)]
        self._shown = shown
        self.refresh()

    def render_line(self, y: int) -> Strip:
        lines = self._lines
        if lines is None:
            return super().render_line(y)
        if y < len(lines):
            return lines[y]
        return Strip.blank(self.content_size.width, self.visual_style.rich_style)

    def on_resize(self) -> None:
        self._draw()  # the plot is drawn for a size: a new layout (z, a panel folding) redraws it

    def on_focus(self) -> None:
        self._draw()  # the caption lists the keys while focused

    def on_blur(self) -> None:
        self._draw()
