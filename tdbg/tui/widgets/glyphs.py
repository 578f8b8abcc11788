"""Text-only drawing helpers: block sparklines and gauges, shared by several widgets."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BLOCKS = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉█"


def spark(values: Sequence[float] | np.ndarray, width: int, log: bool = False) -> str:
    """A one-line sparkline of the last ``width`` values; non-finite values show as ``!``."""
    arr = np.asarray(values, dtype=np.float64)[-width:]
    if arr.size == 0:
        return ""
    finite = np.isfinite(arr)
    if log:
        with np.errstate(all="ignore"):
            arr = np.where(arr > 0, np.log10(np.where(arr > 0, arr, 1.0)), np.nan)
        finite = np.isfinite(arr)
    if not finite.any():
        return "!" * arr.size
    lo, hi = float(arr[finite].min()), float(arr[finite].max())
    span = hi - lo
    out = []
    for v, ok in zip(arr.tolist(), finite.tolist(), strict=True):
        if not ok:
            out.append("!")
        elif span <= 0:
            out.append(BLOCKS[3])
        else:
            out.append(BLOCKS[min(7, int((v - lo) / span * 8))])
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
