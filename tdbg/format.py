"""Numbers and units as the TUI and the CLI both print them: one spelling per unit.

Every formatter takes whatever a message held (a figure may be None, NaN, or not a number at all
from a buggy probe) and never raises: a figure that cannot be shown reads ``n/a``. Figures get
three significant digits; units follow the number without a space for durations (``812µs``,
``12.3ms``, ``1.23s``: they fit narrow table cells) and with one for bytes and wall seconds
(``4 KiB``, ``1.06 s``).
"""

from __future__ import annotations

import math
from typing import Any

NA = "n/a"
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def number(value: object) -> float | None:
    """``value`` as a float when it is a real number (a bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _spelled(value: float) -> str:
    """A non-finite figure spelled out: it is the news (a NaN loss), not a missing figure. The
    one spelling on screen: ``NaN``, ``+inf``, ``-inf`` (``tdbg dump``'s JSON encodes them as
    the strings "nan", "inf", "-inf" instead: a documented format, read back by unfinite())."""
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def fmt(value: object, spec: str = ".3g", unit: str = "") -> str:
    """A figure with a format spec (``"d"`` rounds to a whole number), or ``n/a`` when it is
    missing, NaN or not a number."""
    v = number(value)
    if v is None or math.isnan(v):
        return NA
    if spec == "d":
        if not math.isfinite(v):
            return _spelled(v)
        return f"{round(v)}{unit}"
    return f"{v:{spec}}{unit}"


def fmt_loss(value: object) -> str:
    """A loss: four significant digits; NaN and inf spelled out, a missing loss ``n/a``."""
    v = number(value)
    if v is None:
        return NA
    return f"{v:.4g}" if math.isfinite(v) else _spelled(v)


def fmt_stat(value: object) -> str:
    """A statistic (activation mean, an input's min): three significant digits; NaN and inf
    spelled out, a missing one ``n/a``."""
    v = number(value)
    if v is None:
        return NA
    return f"{v:.3g}" if math.isfinite(v) else _spelled(v)


def _scaled(value: float, units: tuple[str, ...], step: float, sep: str) -> str:
    """``value`` in the largest unit that keeps it below ``step``, three significant digits
    (whole numbers from 1000 up, never an exponent); a figure that rounds up to ``step`` moves
    to the next unit (``999.7µs`` reads ``1ms``)."""
    for i, unit in enumerate(units):
        text = f"{value:.3g}"
        if "e" in text:
            text = f"{value:.0f}"
        if i == len(units) - 1 or abs(float(text)) < step:
            return f"{text}{sep}{unit}"
        value /= step
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_bytes(value: object) -> str:
    """Bytes with a binary unit: ``812 B``, ``4 KiB``, ``1.5 GiB``; freed memory keeps its sign."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return NA
    if abs(v) < 1024:
        return f"{v:.0f} B"
    return _scaled(v / 1024, _BYTE_UNITS[1:], 1024, " ")


def fmt_us(value: object) -> str:
    """A duration given in microseconds, at most 7 characters: ``812µs``, ``12.3ms``, ``1.23s``."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return NA
    if v == 0:
        return "0µs"
    return _scaled(v, ("µs", "ms", "s"), 1000, "")


def fmt_seconds(value: object) -> str:
    """A duration in seconds (a profile's wall time): ``1.06 s``, ``0.524 s``, ``95 s``."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return NA
    text = f"{v:.3g}"
    return f"{v:.0f} s" if "e" in text else f"{text} s"


def fmt_duration(seconds: object) -> str:
    """Elapsed time as ``H:MM:SS``; ``n/a`` when missing, non-finite or negative."""
    v = number(seconds)
    if v is None or not math.isfinite(v) or v < 0:
        return NA
    s = int(v)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def fmt_percent(fraction: object, spec: str = ".1f") -> str:
    """A fraction 0-1 as a percentage figure (no sign): ``51.0``; ``n/a`` when missing."""
    v = number(fraction)
    if v is None or math.isnan(v):
        return NA
    return f"{100 * v:{spec}}"


def fmt_pct(fraction: object, spec: str = ".1f") -> str:
    """A fraction 0-1 as a percentage with its sign: ``51.0%``; ``n/a`` when missing."""
    text = fmt_percent(fraction, spec)
    return text if text == NA else f"{text}%"


def fmt_span(seconds: object) -> str:
    """A short span as people say it: ``45s``, ``1m03s``, ``2h05m``; ``n/a`` when unknown."""
    v = number(seconds)
    if v is None or not math.isfinite(v) or v < 0:
        return NA
    s = int(v)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


_SI = ((1e9, "G"), (1e6, "M"), (1e3, "k"))


def fmt_rate(value: object) -> str:
    """A rate per second (steps/s, samples/s, tokens/s) without an exponent: one decimal from
    0.1 to 100 (``16.9``, ``0.4``, ``0.0`` while stalled), whole from 100 (``812``), k/M/G from
    10,000 (``328k``, ``1.25M``), two significant digits below 0.1 (``0.05``)."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return NA
    size = abs(v)
    if size >= 1e4:
        for scale, suffix in _SI:
            if size >= scale:
                text = f"{v / scale:.3g}"
                return f"{text if 'e' not in text else f'{v / scale:.0f}'}{suffix}"
    if size >= 99.95:
        return f"{v:.0f}"
    if size >= 0.1 or v == 0:
        return f"{v:.1f}"
    return f"{v:.2g}"


def fmt_params(value: object) -> str:
    """A count of parameters (or elements): whole below 10,000 (``4128``), then with k/M/G and
    three significant digits (``33k``, ``1.25M``, ``7.24G``)."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return NA
    if abs(v) >= 1e4:
        for scale, suffix in _SI:
            if abs(v) >= scale:
                return f"{v / scale:.3g}{suffix}"
    return f"{v:.0f}"


def fmt_count(value: object, noun: str) -> str:
    """A whole count with its noun, singular for one: ``1 step``, ``10 steps``, ``n/a steps``."""
    v = number(value)
    if v is None or not math.isfinite(v):
        return f"{NA} {noun}s"
    n = round(v)
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def fmt_every(value: object, noun: str = "step") -> str:
    """How often, as people say it: ``every step``, ``every 10 steps``."""
    v = number(value)
    if v is not None and math.isfinite(v) and round(v) == 1:
        return f"every {noun}"
    return f"every {fmt_count(value, noun)}"


SPARKS = "▁▂▃▄▅▆▇█"


def spark_bars(series: list[list[float]]) -> tuple[list[str], bool]:
    """Sparklines of one or more series on one scale, so heights compare across them (a log
    scale when every value is positive and they span over two decades; a non-finite point is
    ``×``), and whether the scale is log. ``tdbg report`` and ``tdbg compare`` draw with it."""
    finite = [v for values in series for v in values if math.isfinite(v)]
    if not finite:
        return ["×" * len(values) for values in series], False
    log = min(finite) > 0 and max(finite) / min(finite) > 100
    scaled = [[math.log10(v) if log and math.isfinite(v) else v for v in s] for s in series]
    low = min(math.log10(v) if log else v for v in finite)
    span = max(math.log10(v) if log else v for v in finite) - low or 1.0
    top = len(SPARKS) - 1
    bars = [
        "".join(
            SPARKS[min(top, int((v - low) / span * len(SPARKS)))] if math.isfinite(v) else "×"
            for v in values
        )
        for values in scaled
    ]
    return bars, log


# --- JSON (tdbg dump, --json): it has no NaN/Infinity ---------------------------------------


def finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def unfinite(value: Any) -> Any:
    """The inverse of :func:`finite`: "nan", "inf" and "-inf" back to floats."""
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def finite_tree(value: Any) -> Any:
    """:func:`finite` through nested maps and lists (command results, activation stats)."""
    if isinstance(value, dict):
        return {str(k): finite_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_tree(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return finite(value)
