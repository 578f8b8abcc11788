"""Chart axes as a reader wants them: integer step ticks, a y-range fitted to the visible window."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Quantiles of the visible values that bound a robust y-range: the first steps' loss (often 10x
# the rest) must not squeeze the recent curve into two rows.
ROBUST_LOW = 0.01
ROBUST_HIGH = 0.98
WARMUP_SHARE = 0.1  # the oldest tenth of the window does not set a robust range
TAIL_SHARE = 0.25  # the newest quarter of the window is always fully in range
PAD = 0.05  # of the range, above and below, so the curve does not sit on the frame
MIN_WINDOW = 8  # steps: zooming in stops here
PAN_SHARE = 0.25  # of the window, per press of pan


def step_label(step: int) -> str:
    """A step count as an axis label: ``950``, ``1k``, ``1.5k``, ``12k``, ``1.2M``."""
    for size, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if abs(step) >= size:
            value = step / size
            text = f"{value:.1f}" if abs(value) < 10 and value != int(value) else f"{value:.0f}"
            if float(text) != value:  # a tick that is not a round number keeps its digits
                text = f"{value:.3g}"
            return text + suffix
    return str(step)


def step_ticks(lo: float, hi: float, max_ticks: int) -> list[int]:
    """As many whole steps in ``[lo, hi]``, a round stride apart (1, 2, 5 x 10^k), as fit in
    ``max_ticks``: never a fractional or negative step."""
    first, last = max(0, math.ceil(lo)), math.floor(hi)
    if last < first or max_ticks < 1:
        return []
    magnitude = 10 ** max(0, math.floor(math.log10(max(1, last - first))) - 1)
    for stride in (m * magnitude * scale for scale in (1, 10, 100) for m in (1, 2, 5)):
        start = math.ceil(first / stride) * stride
        if (last - start) // stride + 1 <= max_ticks:
            return list(range(start, last + 1, stride))
    return [first]


def value_ticks(lo: float, hi: float, max_ticks: int) -> list[float]:
    """As many round values (1, 2, 5 x 10^k apart) in ``[lo, hi]`` as fit in ``max_ticks``:
    ``0.2 0.4 0.6``, not ``0.05 0.37 0.69``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo or max_ticks < 1:
        return []
    magnitude = 10 ** math.floor(math.log10(hi - lo))
    for stride in (m * magnitude * scale for scale in (0.01, 0.1, 1, 10) for m in (1, 2, 5)):
        # The epsilon keeps a tick that sits on an end (1.4 / 0.2 = 6.999...) inside.
        first, last = math.ceil(lo / stride - 1e-9), math.floor(hi / stride + 1e-9)
        if last - first + 1 <= max_ticks:
            return [round(k * stride, 12) for k in range(first, last + 1)]
    return []


def log_ticks(lo: float, hi: float, max_ticks: int) -> list[float]:
    """The ticks of a log axis over ``[lo, hi]``: the powers of ten inside it (every second,
    third, ... when more than ``max_ticks``), or, on a range within one decade that holds
    fewer than two, the round values ``value_ticks`` gives (``0.4 0.6 0.8``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi <= lo or max_ticks < 1:
        return []
    first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    if last - first + 1 < 2:
        return value_ticks(lo, hi, max_ticks)
    stride = math.ceil((last - first + 1) / max_ticks)
    return [10.0**k for k in range(first, last + 1, stride)]


def value_label(value: float) -> str:
    """A y tick: three significant digits, no trailing zeros (``0.2``, ``1.5``, ``2e+03``)."""
    return f"{value:.3g}"


@dataclass(frozen=True, slots=True)
class StepWindow:
    """Which steps the chart shows: the last ``size`` steps ending ``offset`` steps before the
    newest (0 follows the run), or every step when ``size`` is None."""

    size: int | None = None
    offset: int = 0

    def bounds(self, first: int, last: int) -> tuple[int, int]:
        """The visible ``[lo, hi]`` steps of a run that spans ``[first, last]``."""
        if self.size is None or self.size >= last - first:
            return first, last
        hi = max(first + self.size, last - self.offset)
        return hi - self.size, hi

    def zoomed(self, factor: float, first: int, last: int) -> StepWindow:
        """Half (0.5) or twice (2) the window, keeping its right edge; all steps once it covers
        the run."""
        span = max(1, last - first)
        size = span if self.size is None else self.size
        new = max(MIN_WINDOW, int(size * factor))
        if new >= span:
            return StepWindow(None, 0)
        return StepWindow(new, min(self.offset, span - new))

    def panned(self, direction: int, first: int, last: int) -> StepWindow:
        """A quarter window towards older (-1) or newer (+1) steps; at the newest it follows."""
        if self.size is None:
            return self
        span = max(1, last - first)
        move = max(1, int(self.size * PAN_SHARE))
        offset = self.offset - direction * move
        return StepWindow(self.size, min(max(0, offset), max(0, span - self.size)))


def y_range(
    values: np.ndarray, robust: bool, log: bool = False, rows: int | None = None
) -> tuple[float, float] | None:
    """The y-limits for ``values`` (in step order, NaN and inf ignored; on a log scale only the
    positive ones): every value when not ``robust``, else the bulk of them (quantiles past the
    oldest tenth, where a fresh run's loss starts high) and the whole newest quarter, padded a
    little: on a plot of ``rows`` rows at most a quarter row (one braille dot) each side, so
    that no row of the plot stands empty. None when there is nothing finite to show."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if log:
        v = np.log10(v[v > 0])
    if not v.size:
        return None
    if robust and v.size >= 8:
        body = v[int(v.size * WARMUP_SHARE) :]
        tail = v[-max(1, int(v.size * TAIL_SHARE)) :]
        lo = min(float(np.quantile(body, ROBUST_LOW)), float(tail.min()))
        hi = max(float(np.quantile(body, ROBUST_HIGH)), float(tail.max()))
    else:
        lo, hi = float(v.min()), float(v.max())
    if hi <= lo:  # a flat line: give it some room around its value
        half = abs(lo) * 0.05 or 0.5
        lo, hi = lo - half, hi + half
    pad = (hi - lo) * (PAD if not rows else min(PAD, 1 / (4 * rows)))
    lo, hi = lo - pad, hi + pad
    if log:
        return 10.0**lo, 10.0**hi
    return lo, hi


def first_nonfinite(
    steps: np.ndarray, values: np.ndarray, present: np.ndarray | None
) -> int | None:
    """The first step whose value is NaN or inf; where ``present`` is None, a NaN before the
    first finite value is taken for a missing value, not a non-finite one."""
    v = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(v)
    if present is not None:
        bad &= np.asarray(present, dtype=bool)
    else:
        finite = np.flatnonzero(~bad)
        start = int(finite[0]) if finite.size else len(v)
        bad[:start] = np.isinf(v[:start])
    where = np.flatnonzero(bad)
    return int(steps[where[0]]) if where.size else None
