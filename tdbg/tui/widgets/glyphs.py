"""Text-only drawing helpers: block sparklines and gauges, shared by several widgets."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BLOCKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉█"


def spark(
    values: Sequence[float] | np.ndarray,
    width: int,
    log: bool = False,
    bounds: tuple[float, float] | None = None,
    gaps: Sequence[bool] | np.ndarray | None = None,
) -> str:
    """A one-line sparkline of the last ``width`` values; non-finite values show as ``!`` (a
    zero on a ``log`` scale as the lowest block).

    The heights span the values' own min..max, or ``bounds`` (in log10 units with ``log``)
    when several sparklines must be compared on one scale. ``gaps`` (one flag per value):
    values that are no value at all, shown as blanks."""
    arr = np.asarray(values, dtype=np.float64)[-width:]
    if arr.size == 0:
        return ""
    blank = np.zeros(arr.size, dtype=bool)
    if gaps is not None and len(gaps) == len(values):
        blank = np.asarray(gaps, dtype=bool)[-width:]
    finite = np.isfinite(arr)
    floor = np.zeros(arr.size, dtype=bool)  # on a log scale, a zero (or less): the lowest block
    if log:
        floor = finite & (arr <= 0)
        with np.errstate(all="ignore"):
            arr = np.where(arr > 0, np.log10(np.where(arr > 0, arr, 1.0)), np.nan)
        finite = np.isfinite(arr)
    if not finite.any():
        marks = zip(blank.tolist(), floor.tolist(), strict=True)
        return "".join(" " if b else (BLOCKS[0] if z else "!") for b, z in marks)
    lo, hi = bounds if bounds is not None else (float(arr[finite].min()), float(arr[finite].max()))
    span = hi - lo
    out = []
    for v, ok, gap, zero in zip(
        arr.tolist(), finite.tolist(), blank.tolist(), floor.tolist(), strict=True
    ):
        if gap:
            out.append(" ")
        elif zero:
            out.append(BLOCKS[0])
        elif not ok:
            out.append("!")
        elif span <= 0:
            out.append(BLOCKS[3])
        else:
            out.append(BLOCKS[min(7, max(0, int((v - lo) / span * 8)))])
    return "".join(out)


def gauge(fraction: float | None, width: int) -> str:
    """A horizontal bar ``width`` cells wide filled to ``fraction`` (eighth-cell resolution)."""
    if fraction is None or not math.isfinite(fraction):
        return "·" * width
    fraction = min(1.0, max(0.0, fraction))
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    bar = "█" * full + (EIGHTHS[part] if part and full < width else "")
    return bar + " " * (width - len(bar))


def log_bar(value: float, lo: float, span: float, width: int) -> str:
    """A bar for a norm on a log scale from 10**lo to 10**(lo + span): a finite nonzero norm
    gets at least one cell, so the smallest layer still shows; an exact zero is the only empty
    bar; NaN / Inf fill the bar with ``×``."""
    if not math.isfinite(value):
        return "×" * width
    if value <= 0:
        return " " * width
    fraction = (math.log10(value) - lo) / span if span > 0 else 1.0
    # One full cell is the floor; the log scale fills the rest.
    return "█" + gauge(fraction, width - 1) if width > 1 else "█"
