"""DistributionMap: one layer's magnitude histogram over the counted steps, bins x steps."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widget import Widget

from tdbg.model.distributions import Counted, decade_labels, fractions, per_decade
from tdbg.protocol.messages.histograms import bin_labels

# A cell's glyph by the share of the layer's elements in its bin: shapes, not colours alone,
# so that it reads on any theme and in a plain-text capture.
SHADES = ((0.5, "█"), (0.1, "▓"), (0.01, "▒"), (0.0, "░"))
COLOURS = ("red", "yellow", "green", "blue")  # the same steps, by share: most to least
AXIS = 1  # the steps' line under the cells


def shade(share: float) -> tuple[str, str]:
    """(glyph, colour) of a cell holding ``share`` of its step's elements; nothing: a dot."""
    if share <= 0.0:
        return "·", "bright_black"
    for (least, glyph), colour in zip(SHADES, COLOURS, strict=True):
        if share >= least:
            return glyph, colour
    return "░", "blue"


class DistributionMap(Widget):
    """Rows are the bins (the largest magnitudes on top, non-finite above them), columns the
    latest counted steps that fit, oldest left. Short of rows, the half-decade bins merge
    into decades."""

    DEFAULT_CSS = """
    DistributionMap { height: 1fr; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._series: list[Counted] = []

    def show(self, series: list[Counted]) -> None:
        self._series = series
        self.refresh()

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        series = self._series
        if not series:
            return Text("no histogram of this kind for this layer yet", style="italic")
        shares = fractions(series)
        labels = bin_labels()
        if height - AXIS < len(labels):
            shares, labels = per_decade(shares), decade_labels()
        label_width = max(len(label) for label in labels) + 1
        columns = max(1, min(shares.shape[1], width - label_width - 1))
        shares = shares[:, -columns:]
        shown = series[-columns:]
        text = Text(no_wrap=True, overflow="crop")
        for row in range(len(labels) - 1, -1, -1):
            text.append(labels[row].rjust(label_width - 1) + " ", "bright_black")
            for share in shares[row]:
                glyph, colour = shade(float(share))
                text.append(glyph, colour)
            text.append("\n")
        first, last = str(shown[0].step), str(shown[-1].step)
        axis = " " * label_width + first
        gap = label_width + columns - len(axis) - len(last)
        axis += " " * gap + last if gap > 0 else ""
        text.append(axis, "bright_black")
        return text
