"""A framed braille line chart drawn with numpy: points, lines, vertical markers, tick labels."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

RGB = tuple[int, int, int]

BLANK = 0x2800  # the braille block with no dot raised: a cell's dots are bits added to it
# The bit of each dot in a cell, by the dot's row (0 top .. 3 bottom) and column (0 left, 1 right).
DOT_BITS = np.array([[0x01, 0x08], [0x02, 0x10], [0x04, 0x20], [0x40, 0x80]], dtype=np.uint8)
MARKER = "│"  # a vertical marker fills its column of cells with this
CORNERS = "┌┐└┘"
Y_TICK, X_TICK, FRAME_H, FRAME_V = "┤", "┬", "─", "│"


@dataclass(frozen=True, slots=True)
class Series:
    """Points ``(x, y)`` in one colour; ``line`` joins each point to the next (a NaN between
    two points leaves a gap). Drawn in order: a later series owns the cells it touches."""

    x: np.ndarray
    y: np.ndarray
    rgb: RGB
    line: bool = False


@dataclass(frozen=True, slots=True)
class Axes:
    """What the frame shows: x and y limits (the canvas's first and last dots), a log y-axis
    (limits and ticks are values, drawn on their log10), and the ticks as ``(value, label)``."""

    x_lim: tuple[float, float]
    y_lim: tuple[float, float]
    log: bool = False
    x_ticks: Sequence[tuple[float, str]] = ()
    y_ticks: Sequence[tuple[float, str]] = ()


class Scale:
    """Maps values to dots of a canvas of ``cols`` x ``rows`` cells (two by four dots each):
    the x limits to the first and last dot column, the y limits to the bottom and top dot row
    (row 0 is the top)."""

    def __init__(self, cols: int, rows: int, axes: Axes) -> None:
        self.cols, self.rows, self.log = cols, rows, axes.log
        x0, x1 = (float(v) for v in axes.x_lim)
        y0, y1 = (self._y(float(v)) for v in axes.y_lim)
        # A single step or a flat value: the limits are widened, never divided by zero.
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1.0)
        self.y0, self.y1 = (y0, y1) if y1 > y0 else (y0 - 0.5, y0 + 0.5)

    def _y(self, y: float) -> float:
        if not self.log:
            return y
        return math.log10(y) if y > 0 else math.nan

    def dx(self, x: np.ndarray) -> np.ndarray:
        """Dot columns of ``x``, unrounded."""
        return (np.asarray(x, dtype=np.float64) - self.x0) * (
            (2 * self.cols - 1) / (self.x1 - self.x0)
        )

    def dy(self, y: np.ndarray) -> np.ndarray:
        """Dot rows of ``y`` (0 top), unrounded; NaN where a log axis cannot place it."""
        v = np.asarray(y, dtype=np.float64)
        if self.log:
            with np.errstate(invalid="ignore", divide="ignore"):
                v = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
        return (self.y1 - v) * ((4 * self.rows - 1) / (self.y1 - self.y0))

    def col_of(self, x: float) -> int | None:
        """The cell column of ``x``; None off the canvas."""
        dot = (x - self.x0) * ((2 * self.cols - 1) / (self.x1 - self.x0))
        if not -0.5 <= dot < 2 * self.cols - 0.5:  # NaN fails too
            return None
        return math.floor(dot + 0.5) // 2

    def row_of(self, y: float) -> tuple[int, float] | None:
        """The cell row of ``y`` and how far (in dots) ``y`` lies from that row's middle; None
        off the canvas (or not positive on a log axis)."""
        if self.log:
            if not y > 0:
                return None
            y = math.log10(y)
        dot = (self.y1 - y) * ((4 * self.rows - 1) / (self.y1 - self.y0))
        if not -0.5 <= dot < 4 * self.rows - 0.5:
            return None
        row = math.floor(dot + 0.5) // 4
        return row, abs(dot - (4 * row + 1.5))


def _segments(px: np.ndarray, py: np.ndarray, width: int, height: int) -> tuple[np.ndarray, ...]:
    """The dots of the line through ``(px, py)`` (dot coordinates; a NaN breaks it), each
    segment clipped to the canvas first: a line to a point a million canvases away costs what
    its visible part costs (a converged run joined to its first steps' loss once asked a
    plotting library for gigabytes)."""
    x0, y0, x1, y1 = px[:-1], py[:-1], px[1:], py[1:]
    ok = np.isfinite(x0) & np.isfinite(y0) & np.isfinite(x1) & np.isfinite(y1)
    x0, y0, x1, y1 = x0[ok], y0[ok], x1[ok], y1[ok]
    lo = np.zeros_like(x0)
    hi = np.ones_like(x0)
    # Liang-Barsky: the part of each segment with both coordinates within half a dot of the
    # canvas, as a range [lo, hi] of its parameter t.
    with np.errstate(divide="ignore", invalid="ignore"):
        for a, b, top in ((x0, x1, width - 0.5), (y0, y1, height - 0.5)):
            d = b - a
            flat = d == 0
            ta = (-0.5 - a) / d
            tb = (top - a) / d
            enter = np.where(
                flat, np.where((a >= -0.5) & (a <= top), -np.inf, np.inf), np.minimum(ta, tb)
            )
            leave = np.where(
                flat, np.where((a >= -0.5) & (a <= top), np.inf, -np.inf), np.maximum(ta, tb)
            )
            lo = np.maximum(lo, enter)
            hi = np.minimum(hi, leave)
    keep = lo <= hi
    x0, y0, dx, dy, lo, hi = (
        x0[keep],
        y0[keep],
        (x1 - x0)[keep],
        (y1 - y0)[keep],
        lo[keep],
        hi[keep],
    )
    ax, ay = x0 + lo * dx, y0 + lo * dy
    bx, by = x0 + hi * dx, y0 + hi * dy
    # One sample per dot along the longer side of each clipped segment, ends included (a
    # length of 1 + 1e-12 is one dot: a sample more would round to a stair beside the line).
    n = np.ceil(np.maximum(np.abs(bx - ax), np.abs(by - ay)) - 1e-6).astype(np.int64) + 1
    total = int(n.sum())
    if not total:
        return np.empty(0), np.empty(0)
    which = np.repeat(np.arange(len(n)), n)
    k = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    t = k / np.maximum(n - 1, 1)[which]
    return ax[which] + t * (bx - ax)[which], ay[which] + t * (by - ay)[which]


def dots(series: Series, scale: Scale) -> tuple[np.ndarray, np.ndarray]:
    """The dots ``series`` raises on the canvas, as (column, row) arrays, row 0 at the top:
    points off the canvas (not finite, or not positive on a log axis) raise none."""
    width, height = 2 * scale.cols, 4 * scale.rows
    px, py = scale.dx(series.x), scale.dy(series.y)
    if series.line and len(px) > 1:
        lx, ly = _segments(px, py, width, height)
        px, py = np.concatenate([px, lx]), np.concatenate([py, ly])
    ok = np.isfinite(px) & np.isfinite(py)
    # Half a dot rounds to the next (floor(v + .5)), the same on both sides of zero.
    cx = np.floor(px[ok] + 0.5).astype(np.int64)
    cy = np.floor(py[ok] + 0.5).astype(np.int64)
    inside = (cx >= 0) & (cx < width) & (cy >= 0) & (cy < height)
    return cx[inside], cy[inside]


def cells(cx: np.ndarray, cy: np.ndarray, cols: int, rows: int) -> np.ndarray:
    """Dots folded into cells: each cell's braille bits (0: no dot), ``rows`` x ``cols``."""
    bits = np.zeros(rows * cols, dtype=np.uint8)
    np.bitwise_or.at(bits, (cy >> 2) * cols + (cx >> 1), DOT_BITS[cy & 3, cx & 1])
    return bits.reshape(rows, cols)


def _utf32(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Chart:
    """A drawn chart: its lines joined by newlines, and its coloured runs as ``(start, end,
    colour)`` offsets into them (everything else, frame and labels, has no colour of its own)."""

    plain: str
    runs: list[tuple[int, int, RGB]]

    def strips(self, base: Style) -> list[Strip]:
        """As a widget's lines: each line's segments in ``base`` (the widget's own colours and
        background), its coloured runs in ``base`` with their colour over it. What a widget
        draws through Textual's visuals costs ~5 ms a chart at 120x40 (a Content's lines
        wrapped, divided by span and styled a segment at a time); these cost ~0.3 ms."""
        rows = self.plain.split("\n")
        stride = len(rows[0]) + 1
        styled: dict[RGB, Style] = {}
        runs = iter(self.runs)
        run = next(runs, None)
        strips = []
        for r, row in enumerate(rows):
            start, end = r * stride, r * stride + len(row)
            segments = []
            at = start
            while run is not None and run[0] < end:
                a, b, rgb = run
                if a > at:
                    segments.append(Segment(row[at - start : a - start], base))
                style = styled.get(rgb)
                if style is None:
                    style = styled[rgb] = base + _rich_style(rgb)
                segments.append(Segment(row[a - start : b - start], style))
                at = b
                run = next(runs, None)
            if at < end or not segments:
                segments.append(Segment(row[at - start :], base))
            strips.append(Strip(segments, len(row)))
        return strips


@lru_cache(maxsize=64)
def _rich_style(rgb: RGB) -> Style:
    return Style(color=Color.from_rgb(*rgb))


def draw(
    width: int,
    height: int,
    axes: Axes,
    series: Sequence[Series] = (),
    markers: Sequence[tuple[float, RGB]] = (),
) -> Chart:
    """The chart in ``width`` x ``height`` cells: a frame with the y labels left of it and the
    x labels under it, the series' dots inside, and a vertical marker line at each
    ``(x, colour)`` of ``markers`` (drawn last, over the series)."""
    height = max(height, 4)
    rows = height - 3  # the frame's top and bottom, the x labels
    y_ticks = [(v, label) for v, label in axes.y_ticks if label]
    label_width = max((len(label) for _, label in y_ticks), default=0)
    if width - label_width - 2 < 1:  # no room for the labels: the canvas keeps its column
        y_ticks, label_width = [], 0
    cols = max(1, width - label_width - 2)
    width = label_width + cols + 2
    scale = Scale(cols, rows, axes)

    # The canvas: each series' cells, a later series owning the cells it touches.
    bits = np.zeros((rows, cols), dtype=np.uint8)
    owner = np.full((rows, cols), -1, dtype=np.int16)
    colours: list[RGB] = []
    for k, s in enumerate(series):
        mine = cells(*dots(s, scale), cols, rows)
        touched = mine != 0
        bits[touched] = mine[touched]
        owner[touched] = k
        colours.append(s.rgb)
    chars = np.where(bits != 0, BLANK + bits.astype(np.uint32), ord(" ")).astype(np.uint32)
    for x, rgb in markers:
        col = scale.col_of(x)
        if col is not None:
            chars[:, col] = ord(MARKER)
            owner[:, col] = len(colours)
            colours.append(rgb)

    # The whole chart as code points, one row per line (the newline is the last column).
    grid = np.full((height, width + 1), ord(" "), dtype=np.uint32)
    grid[:, -1] = ord("\n")
    left = label_width  # the frame's left column
    grid[1 : rows + 1, left + 1 : left + 1 + cols] = chars
    grid[0, left], grid[0, left + cols + 1] = ord(CORNERS[0]), ord(CORNERS[1])
    grid[rows + 1, left], grid[rows + 1, left + cols + 1] = ord(CORNERS[2]), ord(CORNERS[3])
    grid[0, left + 1 : left + cols + 1] = ord(FRAME_H)
    grid[rows + 1, left + 1 : left + cols + 1] = ord(FRAME_H)
    grid[1 : rows + 1, left] = ord(FRAME_V)
    grid[1 : rows + 1, left + cols + 1] = ord(FRAME_V)
    # Two ticks in one row (a short plot): the one nearer the row's middle keeps it.
    by_row: dict[int, tuple[float, str]] = {}
    for value, label in y_ticks:
        place = scale.row_of(value)
        if place is not None and (place[0] not in by_row or place[1] < by_row[place[0]][0]):
            by_row[place[0]] = (place[1], label)
    for row, (_, label) in by_row.items():
        grid[row + 1, left] = ord(Y_TICK)
        grid[row + 1, left - len(label) : left] = _utf32(label)
    end = 0  # the first column a further x label may use
    for value, label in axes.x_ticks:
        col = scale.col_of(value)
        if col is None:
            continue
        col += left + 1
        grid[rows + 1, col] = ord(X_TICK)
        start = max(0, min(col - (len(label) - 1) // 2, width - len(label)))  # centred, inside
        if label and start >= end:
            grid[rows + 2, start : start + len(label)] = _utf32(label)
            end = start + len(label) + 1
    plain = grid.tobytes().decode("utf-32-le")[:-1]  # no newline after the last row
    runs = _runs(owner, width + 1, left + 1)
    return Chart(plain, [(a, b, colours[k]) for a, b, k in runs])


def _runs(owner: np.ndarray, stride: int, offset: int) -> list[tuple[int, int, int]]:
    """``(start, end, owner)`` of each coloured run of cells in the canvas, as offsets in the
    chart's text (rows ``stride`` apart, the canvas ``offset`` in from a row's start, its first
    row the text's second). A blank cell takes the colour before it in its row: a space shows
    no colour, and fewer spans are less to draw."""
    rows, cols = owner.shape
    if not rows or not cols:
        return []
    index = np.where(owner >= 0, np.arange(cols), 0)
    np.maximum.accumulate(index, axis=1, out=index)
    filled = np.take_along_axis(owner, index, axis=1)
    # A run starts at a row's first cell or where the colour changes along the row.
    starts = np.ones((rows, cols), dtype=bool)
    starts[:, 1:] = filled[:, 1:] != filled[:, :-1]
    r, c = np.nonzero(starts)
    ends = np.empty_like(c)
    ends[:-1] = np.where(r[1:] == r[:-1], c[1:], cols)
    ends[-1:] = cols
    who = filled[r, c]
    keep = who >= 0
    base = (r[keep] + 1) * stride + offset
    return list(
        zip(
            (base + c[keep]).tolist(), (base + ends[keep]).tolist(), who[keep].tolist(), strict=True
        )
    )
