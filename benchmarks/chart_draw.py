"""What one loss-chart draw costs: the real app's LossChart on a synthetic run, drawn by its
braille renderer, against the same chart drawn through plotext (the renderer it replaced) in the
same process, at 120x40 and 200x60.

    .venv/bin/python benchmarks/chart_draw.py              # 2,000 steps, 60 draws per size
    .venv/bin/python benchmarks/chart_draw.py --repeats 200

A draw is what a repaint with new data costs: the chart's ``_draw()`` (data to the widget's
content: the loss, its smoothed line, five metrics, the NaN marker and the inspect cursor) and
then the widget's lines drawn into strips, as the screen's next paint would. Each arm's draws
alternate with the other's (the machine's drift cancels); medians are printed, and the braille
arm measured against itself (its first and second halves) says the noise. plotext is the
baseline only: tdbg no longer depends on it, and the arm is left out where it is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from rich.text import Text  # noqa: E402
from textual.geometry import Region  # noqa: E402
from waiting import wait_for  # noqa: E402

from tdbg.model.chart_axes import (  # noqa: E402
    step_label,
    step_ticks,
    value_label,
    value_ticks,
    y_range,
)
from tdbg.tui.app import make_app  # noqa: E402
from tdbg.tui.colours import meaning_rgb  # noqa: E402
from tdbg.tui.sources.base import ReplaySource  # noqa: E402
from tdbg.tui.sources.synthetic import RUN, synthetic_run  # noqa: E402
from tdbg.tui.widgets.loss_chart import (  # noqa: E402
    CURSOR_RGB,
    ROWS_PER_TICK,
    TICK_EVERY,
    LossChart,
    bucket_mean,
)


def plotext_draw(chart: LossChart, plt: Any) -> None:
    """The chart as tdbg drew it through plotext until 2026-11-29 (linear axis, fitted range,
    the whole run shown): the same series, marker lines and ticks, its ANSI parsed back into a
    Text. Kept here as the baseline the braille renderer is measured against."""
    width, height = chart.content_size
    data = chart._data
    assert data is not None
    x = data.steps.astype(np.float64)
    y, ys = data.loss, data.smoothed
    lo, hi = int(data.steps[0]), int(data.steps[-1])
    points = max(8, 2 * width)
    limits = y_range(bucket_mean(x, y, points)[1], robust=True, rows=max(1, height - 3))
    assert limits is not None
    fig = plt.figure
    fig.clear()
    fig.plot_size(width, height - 1)
    fig.theme("colorless")
    xr, yr = bucket_mean(x, y, points)
    fig.draw(fig.signal(xr.tolist(), yr.tolist(), marker=plt.marker("braille", (90, 90, 200))))
    for ex, ey, rgb in data.extra:
        xe, ye = bucket_mean(ex.astype(np.float64), ey, points)
        fig.draw(fig.signal(xe.tolist(), ye.tolist(), marker=plt.marker("braille", rgb)))
    xs, yss = bucket_mean(x, ys, points)
    smooth = plt.marker("braille", (240, 180, 60))
    fig.draw(fig.signal(xs.tolist(), yss.tolist(), marker=smooth).lines())
    for step, rgb in ((chart.nan_step, meaning_rgb(chart.app, "bad")), (chart.cursor, CURSOR_RGB)):
        if step is not None:
            fig.draw(fig.segment([step] * 2, list(limits), marker=plt.marker("│", rgb)))
    ticks = step_ticks(lo, hi, max(2, width // TICK_EVERY))
    x_axis = fig.ruler("x")
    x_axis.lim(lo, max(hi, lo + 1))
    x_axis.ticks(ticks, [step_label(t) for t in ticks])
    y_axis = fig.ruler("y")
    y_axis.lim(*limits)
    values = value_ticks(*limits, max(2, (height - 3) // ROWS_PER_TICK))
    y_axis.ticks(values, [value_label(v) for v in values])
    plot = Text.from_ansi(fig.build().string(), no_wrap=True)
    chart._say(Text.assemble(chart.caption(), "\n", plot, no_wrap=True))


def painted(chart: LossChart) -> None:
    """The widget's lines drawn into strips, as the next screen paint draws them."""
    chart.render_lines(Region(0, 0, *chart.outer_size))


async def measure(size: tuple[int, int], steps: int, repeats: int, plt: Any) -> dict[str, Any]:
    messages = synthetic_run(steps=steps, n_layers=4, nan_at=steps - 40)
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == steps, f"{steps} steps", timeout=120)
        chart = app.query_one(LossChart)
        await wait_for(pilot, lambda: chart._data is not None, "the chart's data", timeout=30)
        chart.set_cursor(steps // 2, draw=False)
        arms: dict[str, Callable[[], None]] = {"braille": chart._draw}
        if plt is not None:
            arms["plotext"] = lambda: plotext_draw(chart, plt)
        times: dict[str, list[float]] = {name: [] for name in arms}
        paints: dict[str, list[float]] = {name: [] for name in arms}
        for i in range(repeats):
            for name, draw in arms.items():
                # An unchanged draw is skipped (by the chart, or by SteadyStatic): not here.
                chart._shown = chart._steady_key = None
                t0 = time.perf_counter()
                draw()
                t1 = time.perf_counter()
                painted(chart)
                t2 = time.perf_counter()
                if i >= 3:  # the first draws warm caches up
                    times[name].append(t1 - t0)
                    paints[name].append(t2 - t1)
        width, height = chart.content_size
        return {"chart": f"{width}x{height}", "draw": times, "paint": paints}


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    try:
        import plotext as plt
    except ImportError:
        plt = None
        print("plotext is not installed: the braille renderer alone")
    print("| screen | chart | braille draw + paint (ms) | plotext draw + paint (ms) | ratio |")
    print("|---|---|---:|---:|---:|")
    for size in ((120, 40), (200, 60)):
        got = asyncio.run(measure(size, args.steps, args.repeats, plt))
        b_draw, b_paint = got["draw"]["braille"], got["paint"]["braille"]
        b_total = [d + p for d, p in zip(b_draw, b_paint, strict=True)]
        half = len(b_total) // 2
        noise = statistics.median(b_total[half:]) / statistics.median(b_total[:half])
        braille = f"{ms(b_draw)} + {ms(b_paint)} = **{ms(b_total)}** (halves {noise:.2f})"
        plotext, ratio = "-", "-"
        if plt is not None:
            p_draw, p_paint = got["draw"]["plotext"], got["paint"]["plotext"]
            p_total = [d + p for d, p in zip(p_draw, p_paint, strict=True)]
            plotext = f"{ms(p_draw)} + {ms(p_paint)} = {ms(p_total)}"
            ratio = f"{statistics.median(p_total) / statistics.median(b_total):.0f}x"
        print(f"| {size[0]}x{size[1]} | {got['chart']} | {braille} | {plotext} | {ratio} |")


if __name__ == "__main__":
    main()
