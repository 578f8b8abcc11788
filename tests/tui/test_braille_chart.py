"""The braille chart renderer, dot by dot: where points and lines land, log axes, gaps, ticks,
markers, colours, and every width from 10 to 300 drawing exactly its size."""

from __future__ import annotations

import numpy as np
import pytest
from rich.color import Color
from rich.style import Style as RichStyle

from tdbg.tui.widgets.braille_chart import BLANK, Axes, Chart, Scale, Series, dots, draw

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def canvas(chart: Chart) -> list[str]:
    """The rows inside the frame, without the frame."""
    lines = chart.plain.split("\n")
    left = lines[0].index("┌")
    return [row[left + 1 : -1] for row in lines[1:-2]]


def raised(chart: Chart) -> set[tuple[int, int]]:
    """Every raised dot of the canvas as (dot column, dot row from the top)."""
    bits = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (0, 3), (1, 3)]  # bit k's dot
    out = set()
    for r, row in enumerate(canvas(chart)):
        for c, ch in enumerate(row):
            code = ord(ch) - BLANK
            if 0 < code < 256:
                out |= {
                    (2 * c + dc, 4 * r + dr) for k, (dc, dr) in enumerate(bits) if code >> k & 1
                }
    return out


def test_corners_land_on_the_corner_dots() -> None:
    # 10 cells by 5: dots 0..19 across, 0..19 down. The limits map to the first and last dot.
    axes = Axes(x_lim=(0, 19), y_lim=(0, 19))
    chart = draw(12, 8, axes, [Series(np.array([0.0, 19, 0, 19]), np.array([0.0, 0, 19, 19]), RED)])
    assert raised(chart) == {(0, 19), (19, 19), (0, 0), (19, 0)}
    rows = canvas(chart)
    assert rows[0] == chr(BLANK + 0x01) + " " * 8 + chr(BLANK + 0x08)
    assert rows[-1] == chr(BLANK + 0x40) + " " * 8 + chr(BLANK + 0x80)


def test_a_known_series_lands_on_known_dots() -> None:
    # y = x on a 20 x 20 dot canvas whose limits are the dots themselves: the diagonal.
    x = np.arange(20.0)
    chart = draw(12, 8, Axes((0, 19), (0, 19)), [Series(x, x, RED)])
    assert raised(chart) == {(i, 19 - i) for i in range(20)}
    # Half a dot rounds up, the same on both sides: 0.5 -> dot 1, 1.49 -> dot 1.
    half = draw(
        12, 8, Axes((0, 19), (0, 19)), [Series(np.array([0.5, 1.49]), np.array([0.0, 0]), RED)]
    )
    assert raised(half) == {(1, 19)}


def test_a_line_joins_its_points_dot_by_dot() -> None:
    chart = draw(
        12,
        8,
        Axes((0, 19), (0, 19)),
        [Series(np.array([0.0, 19]), np.array([0.0, 19]), RED, line=True)],
    )
    assert raised(chart) == {(i, 19 - i) for i in range(20)}
    flat = draw(
        12,
        8,
        Axes((0, 19), (0, 19)),
        [Series(np.array([2.0, 9]), np.array([5.0, 5]), RED, line=True)],
    )
    assert raised(flat) == {(i, 14) for i in range(2, 10)}


def test_a_nan_leaves_a_gap_in_a_line() -> None:
    x = np.array([0.0, 5, 6, 7, 19])
    y = np.array([10.0, 10, np.nan, 10, 10])
    chart = draw(12, 8, Axes((0, 19), (0, 19)), [Series(x, y, RED, line=True)])
    assert raised(chart) == {(i, 9) for i in range(0, 6)} | {(i, 9) for i in range(7, 20)}


def test_a_line_far_off_the_canvas_is_clipped_at_its_edge_in_bounded_work() -> None:
    # A converged run: 1e3 at the first step, ~1e-8 after, on a range 1e-12 wide. The line from
    # the first point is cut where it leaves the canvas and keeps its slope.
    x = np.array([0.0, 1, 19])
    y = np.array([1e3, 1e-8, 1e-8])
    axes = Axes((0, 19), (1e-8 - 1e-12, 1e-8 + 2e-12))  # 1e-8 at dot row 12.67
    scale = Scale(10, 5, axes)
    cx, cy = dots(Series(x, y, RED, line=True), scale)
    assert len(cx) < 100  # a few dots per segment, not 1e15
    got = set(zip(cx.tolist(), cy.tolist(), strict=True))
    assert {(i, 13) for i in range(1, 20)} <= got  # the settled part
    assert got <= {(0, r) for r in range(20)} | {(1, r) for r in range(20)} | {
        (i, 13) for i in range(20)
    }


def test_points_off_the_canvas_and_non_finite_ones_raise_no_dot() -> None:
    x = np.array([-5.0, 25, 3, 4, 5, 6])
    y = np.array([3.0, 3, -1, 40, np.nan, np.inf])
    chart = draw(12, 8, Axes((0, 19), (0, 19)), [Series(x, y, RED)])
    assert raised(chart) == set()


def test_log_axis_places_decades_evenly_and_drops_what_is_not_positive() -> None:
    # 0.01 .. 100 on a log axis over 20 dot rows: each decade 19/4 dots apart.
    y = np.array([0.01, 0.1, 1, 10, 100, 0, -3])
    x = np.array([0.0, 1, 2, 3, 4, 5, 6])
    chart = draw(12, 8, Axes((0, 19), (0.01, 100), log=True), [Series(x, y, RED)])
    expected = {(0, 19), (1, 14), (2, 10), (3, 5), (4, 0)}  # 19 - k * 4.75, rounded half up
    assert raised(chart) == expected


def test_log_y_ticks_sit_on_their_rows() -> None:
    ticks = [(0.01, "0.01"), (1.0, "1"), (100.0, "100")]
    chart = draw(20, 8, Axes((0, 1), (0.01, 100), log=True, y_ticks=ticks))
    lines = chart.plain.split("\n")
    assert lines[1].startswith(" 100┤")  # the top row
    assert lines[3].startswith("   1┤")  # mid-height (dot 9.5 -> row 2)
    assert lines[5].startswith("0.01┤")  # the bottom row


def test_linear_ticks_and_labels_frame_the_canvas() -> None:
    axes = Axes(
        (0, 100),
        (0, 1),
        x_ticks=[(0, "0"), (50, "50"), (100, "100")],
        y_ticks=[(0, "0"), (0.5, "0.5"), (1, "1")],
    )
    chart = draw(30, 10, axes)
    lines = chart.plain.split("\n")
    assert len(lines) == 10 and all(len(line) == 30 for line in lines)
    assert lines[0] == "   ┌" + "─" * 25 + "┐"
    assert lines[1].startswith("  1┤") and lines[7].startswith("  0┤")
    assert [line[:4] for line in lines[2:7]].count("0.5┤") == 1
    bottom = lines[8]
    assert bottom[3] == "└" and bottom[-1] == "┘"
    ticks = [i for i, ch in enumerate(bottom) if ch == "┬"]
    assert ticks == [4, 16, 28]  # dots 0, 24.5 -> 25, 49 of 50 across: cells 0, 12, 24
    assert lines[9].split() == ["0", "50", "100"] and lines[9][4] == "0" and lines[9][16] == "5"


def test_x_labels_that_would_touch_are_left_out() -> None:
    ticks = [(float(v), f"{v}000") for v in range(10)]
    chart = draw(20, 6, Axes((0, 9), (0, 1), x_ticks=ticks))
    labels = chart.plain.split("\n")[-1]
    assert labels.count("┬") == 0 and labels.split()  # some labels, none overlapping
    assert all(word in {f"{v}000" for v in range(10)} for word in labels.split())
    assert chart.plain.split("\n")[-2].count("┬") == 10  # every tick still marked


def test_a_flat_series_and_a_single_point_draw() -> None:
    flat = draw(12, 8, Axes((0, 19), (3, 3)), [Series(np.arange(20.0), np.full(20, 3.0), RED)])
    assert raised(flat) == {(i, 10) for i in range(20)}  # (y0 - .5, y0 + .5): mid-height
    one = draw(
        12, 8, Axes((7, 7), (2, 2)), [Series(np.array([7.0]), np.array([2.0]), RED, line=True)]
    )
    assert raised(one) == {(0, 10)}


@pytest.mark.parametrize("scale", [1e-30, 1e-8, 1.0, 1e8, 1e30])
def test_huge_and_tiny_values_land_as_ordinary_ones(scale: float) -> None:
    x = np.arange(20.0)
    chart = draw(12, 8, Axes((0, 19), (0, 19 * scale)), [Series(x, x * scale, RED, line=True)])
    assert raised(chart) == {(i, 19 - i) for i in range(20)}


def test_later_series_own_their_cells_and_markers_go_over_all() -> None:
    x = np.arange(20.0)
    series = [Series(x, np.full(20, 10.0), RED), Series(x[:10], np.full(10, 10.0), GREEN)]
    chart = draw(12, 8, Axes((0, 19), (0, 19)), series, markers=[(19.0, BLUE)])
    row = 1 + 9 // 4  # dot row 9 is in cell row 2; line 0 is the frame
    start = chart.plain.split("\n")[row]
    offset = sum(len(line) + 1 for line in chart.plain.split("\n")[:row])
    colours = {}
    for a, b, rgb in chart.runs:
        for i in range(a, b):
            colours[i] = rgb
    first = offset + start.index("│") + 1  # the canvas's first cell on that row
    assert [colours.get(first + c) for c in range(10)] == [GREEN] * 5 + [RED] * 4 + [BLUE]
    assert start[first - offset + 9] == "│"
    assert all(line[first - offset + 9] == "│" for line in chart.plain.split("\n")[1:6])


def test_a_marker_off_the_canvas_is_not_drawn() -> None:
    chart = draw(12, 8, Axes((0, 19), (0, 19)), markers=[(25.0, BLUE), (-3.0, BLUE)])
    assert all(set(row) == {" "} for row in canvas(chart)) and not chart.runs


@pytest.mark.parametrize("width", [10, 11, 17, 40, 80, 120, 199, 300])
@pytest.mark.parametrize("height", [4, 5, 23, 60])
def test_every_size_draws_exactly_its_size(width: int, height: int) -> None:
    rng = np.random.default_rng(width * 1000 + height)
    x = np.arange(600.0)
    y = np.cumsum(rng.normal(size=600))
    axes = Axes(
        (0, 599),
        (float(y.min()), float(y.max())),
        x_ticks=[(t, str(t)) for t in range(0, 600, 100)],
        y_ticks=[(v, f"{v:.3g}") for v in np.linspace(y.min(), y.max(), 5)],
    )
    chart = draw(
        width, height, axes, [Series(x, y, RED), Series(x, y, GREEN, line=True)], [(300.0, BLUE)]
    )
    lines = chart.plain.split("\n")
    assert len(lines) == height and {len(line) for line in lines} == {width}
    # Every coloured run lies on one line, and the widget's lines are the text's.
    for a, b, _ in chart.runs:
        assert "\n" not in chart.plain[a:b]
    assert [strip.text for strip in chart.strips(RichStyle())] == lines


def test_no_room_for_labels_keeps_the_canvas() -> None:
    axes = Axes((0, 1), (0, 1), y_ticks=[(0.5, "123456789")])
    chart = draw(10, 5, axes)
    assert all(len(line) == 10 for line in chart.plain.split("\n"))
    assert "123456789" not in chart.plain and "┤" not in chart.plain


def test_two_y_ticks_in_one_row_leave_the_one_nearer_its_middle() -> None:
    # One row of four dots over 0..3: 1 lies 0.5 dots from the middle (1.5), 3 lies 1.5 away.
    chart = draw(12, 4, Axes((0, 1), (0, 3), y_ticks=[(3.0, "3"), (1.0, "1")]))
    assert chart.plain.split("\n")[1].startswith("1┤")


def test_strips_are_the_lines_with_the_runs_coloured_over_the_base() -> None:
    base = RichStyle(bgcolor="grey11", color="white")
    x = np.arange(20.0)
    series = [Series(x, np.full(20, 10.0), RED), Series(x[:10], np.full(10, 10.0), GREEN)]
    chart = draw(12, 8, Axes((0, 19), (0, 19), x_ticks=[(0.0, "0")]), series, [(19.0, BLUE)])
    strips = chart.strips(base)
    assert [strip.text for strip in strips] == chart.plain.split("\n")
    assert all(strip.cell_length == 12 for strip in strips)
    colours: dict[Color | None, set[str]] = {}
    for strip in strips:
        for segment in strip:
            assert segment.style is not None and segment.style.bgcolor == base.bgcolor
            colours.setdefault(segment.style.color, set()).update(segment.text)
    assert colours[Color.from_rgb(*GREEN)] == {
        chr(BLANK + 0x12)
    }  # dot row 9: cell row 2, dots 2 and 5
    assert chr(BLANK + 0x12) in colours[Color.from_rgb(*RED)]
    assert "│" in colours[Color.from_rgb(*BLUE)]
    assert "┌" in colours[base.color] and "0" in colours[base.color]  # frame and labels: base
