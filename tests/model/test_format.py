"""tdbg.format: one spelling per unit for the TUI and the CLI, and never an exception."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tdbg.format import (
    fmt,
    fmt_bytes,
    fmt_duration,
    fmt_loss,
    fmt_percent,
    fmt_seconds,
    fmt_stat,
    fmt_us,
)

NAN, INF = math.nan, math.inf
MISSING = (None, NAN, "12", True, [1])  # absent, unmeasured, or not a number at all


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0µs"),
        (0.5, "0.5µs"),
        (12.34, "12.3µs"),
        (812.0, "812µs"),
        (999.4, "999µs"),
        (999.7, "1ms"),  # rounds up to the next unit, never "1e+03µs"
        (3410.0, "3.41ms"),
        (12_345.0, "12.3ms"),
        (1_200_000.0, "1.2s"),
        (-812.0, "-812µs"),
        (3.6e12, "3600000s"),  # huge: whole seconds, no exponent
        (INF, "n/a"),
    ],
)
def test_us(value: float, text: str) -> None:
    assert fmt_us(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (121 * 1024, "121 KiB"),
        (1023.9 * 1024, "1 MiB"),
        (-3 * 1024 * 1024, "-3 MiB"),
        (-2048, "-2 KiB"),
        (2.5 * 2**30, "2.5 GiB"),
        (2**80, "1073741824 PiB"),
        (-INF, "n/a"),
    ],
)
def test_bytes(value: float, text: str) -> None:
    assert fmt_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "loss", "stat"),
    [
        (0, "0", "0"),
        (1.234567, "1.235", "1.23"),
        (-2.5, "-2.5", "-2.5"),
        (NAN, "NaN", "NaN"),
        (INF, "+inf", "+inf"),
        (-INF, "-inf", "-inf"),
        (1e30, "1e+30", "1e+30"),
        (None, "n/a", "n/a"),
    ],
)
def test_loss_and_stat_spell_non_finite_out(value: float | None, loss: str, stat: str) -> None:
    assert fmt_loss(value) == loss
    assert fmt_stat(value) == stat


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.5236, "0.524 s"), (1.0612, "1.06 s"), (95.0, "95 s"), (0, "0 s"), (1e6, "1000000 s")],
)
def test_seconds(value: float, text: str) -> None:
    assert fmt_seconds(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0:00:00"), (59.9, "0:00:59"), (3725, "1:02:05"), (-1, "n/a"), (INF, "n/a")],
)
def test_duration(value: float, text: str) -> None:
    assert fmt_duration(value) == text


def test_fmt_specs() -> None:
    assert fmt(3, "d") == "3"
    assert fmt(3.0, "d") == "3"  # a whole number that travelled as a float
    assert fmt(2.6, "d", " steps") == "3 steps"
    assert fmt(INF, "d") == "+inf"
    assert fmt(0.0123) == "0.0123"
    assert fmt(12.5, ".1f", "%") == "12.5%"
    assert fmt_percent(0.51) == "51.0"
    assert fmt_percent(None) == "n/a"


@pytest.mark.parametrize("value", MISSING)
def test_anything_that_is_not_a_figure_reads_na(value: object) -> None:
    for formatter in (fmt, fmt_bytes, fmt_us, fmt_seconds, fmt_duration, fmt_percent):
        assert formatter(value) == "n/a", formatter.__name__
    if value is not NAN:  # a NaN loss or statistic is news, spelled out above
        assert fmt_loss(value) == "n/a" and fmt_stat(value) == "n/a"


def test_tui_and_cli_print_with_these() -> None:
    from tdbg.cli import report
    from tdbg.tui.widgets import memory_panel

    assert memory_panel.fmt_bytes is fmt_bytes
    assert report.fmt_us is fmt_us and report.fmt_bytes is fmt_bytes


def test_imports_nothing_heavy() -> None:
    code = (
        "import sys, tdbg.format; "
        "print([m for m in ('torch', 'textual', 'numpy', 'rich') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rates_counts_and_intervals_read_one_way() -> None:
    """steps/s and tokens/s in the TUI and `tdbg status` alike: no exponent, no mixed decimals."""
    from tdbg.format import fmt_count, fmt_every, fmt_rate

    assert [fmt_rate(v) for v in (0.0, 0.05, 0.44, 16.94, 20, 812.4, 327680, 1.25e6)] == [
        "0.0",
        "0.05",
        "0.4",
        "16.9",
        "20.0",
        "812",
        "328k",
        "1.25M",
    ]
    assert fmt_rate(None) == fmt_rate(NAN) == "n/a"
    assert (fmt_count(1, "alert"), fmt_count(3, "alert")) == ("1 alert", "3 alerts")
    assert (fmt_every(1), fmt_every(10), fmt_every(2, "epoch")) == (
        "every step",
        "every 10 steps",
        "every 2 epochs",
    )
