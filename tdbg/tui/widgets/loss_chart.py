"""LossChart: the whole run's loss, raw and smoothed, drawn with plotext into a Static."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import plotext as plt
from rich.text import Text
from textual.widgets import Static


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


class LossChart(Static):
    """Call ``replot(steps, loss, smoothed, log)``; colours come from the component classes."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"loss-chart--raw", "loss-chart--smoothed"}

    def _rgb(self, component: str) -> tuple[int, int, int]:
        color = self.get_component_rich_style(component).color
        if color is None:
            return (200, 200, 200)
        r, g, b = color.get_truecolor()
        return (r, g, b)

    def color_style(self, component: str) -> str:
        """A component's colour as a Rich style string (for a legend beside the chart)."""
        r, g, b = self._rgb(component)
        return f"rgb({r},{g},{b})"

    def replot(
        self,
        steps: np.ndarray,
        loss: np.ndarray,
        smoothed: np.ndarray,
        log: bool,
        extra: Sequence[tuple[np.ndarray, np.ndarray, tuple[int, int, int]]] = (),
    ) -> None:
        """Draw the loss (raw and smoothed) and ``extra`` series ``(steps, values, rgb)``:
        metrics that belong with the loss (val_loss, loss/NAME) on the same axes."""
        width, height = self.content_size
        if width < 10 or height < 4:
            return
        x = steps.astype(np.float64)
        y = loss
        ys = smoothed
        if log:
            y = np.where(y > 0, y, np.nan)
            ys = np.where(ys > 0, ys, np.nan)
        if not np.isfinite(y).any():
            self.update("no finite loss yet" if len(steps) else "waiting for the first step…")
            return
        points = max(8, 2 * width)  # braille: two dots per cell across
        xr, yr = bucket_mean(x, y, points)
        xs, yss = bucket_mean(x, ys, points)
        fig = plt.figure
        fig.clear()
        fig.plot_size(width, height)
        fig.theme("colorless")
        fig.draw(
            fig.signal(
                xr.tolist(), yr.tolist(), marker=plt.marker("braille", self._rgb("loss-chart--raw"))
            )
        )
        if len(yss):
            fig.draw(
                fig.signal(
                    xs.tolist(),
                    yss.tolist(),
                    marker=plt.marker("braille", self._rgb("loss-chart--smoothed")),
                )
            )
        for ex, ey, rgb in extra:
            ey = np.where(ey > 0, ey, np.nan) if log else ey
            xe, ye = bucket_mean(ex.astype(np.float64), ey, points)
            if len(ye):
                fig.draw(fig.signal(xe.tolist(), ye.tolist(), marker=plt.marker("braille", rgb)))
        if log:
            fig.ruler("y").scale("log")
        self.update(Text.from_ansi(fig.build().string(), no_wrap=True))
