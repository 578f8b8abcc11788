"""The loss chart's axes as plain functions: step ticks and labels, the window, the y-range."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tdbg.model.chart_axes import (
    StepWindow,
    first_nonfinite,
    log_ticks,
    step_label,
    step_ticks,
    value_label,
    value_ticks,
    y_range,
)


@pytest.mark.parametrize(
    ("step", "label"),
    [
        (0, "0"),
        (950, "950"),
        (1000, "1k"),
        (1500, "1.5k"),
        (1250, "1.25k"),
        (12_000, "12k"),
        (12_500, "12.5k"),
        (100_000, "100k"),
        (1_200_000, "1.2M"),
        (3_000_000_000, "3G"),
    ],
)
def test_step_labels_are_short_and_never_scientific(step: int, label: str) -> None:
    assert step_label(step) == label


@pytest.mark.parametrize(
    ("lo", "hi", "most"),
    [(0, 1999, 6), (0, 3, 8), (-0.67, 33.3, 5), (190.0, 210.0, 4), (0, 2_500_000, 10), (5, 5, 3)],
)
def test_step_ticks_are_whole_non_negative_round_and_inside(
    lo: float, hi: float, most: int
) -> None:
    ticks = step_ticks(lo, hi, most)
    assert ticks, "a non-empty range gets at least one tick"
    assert len(ticks) <= most
    assert all(isinstance(t, int) and t >= 0 and lo <= t <= hi for t in ticks)
    strides = {b - a for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(strides) <= 1
    if strides:
        stride = strides.pop()
        assert stride / 10 ** math.floor(math.log10(stride)) in (1, 2, 5)


def test_step_ticks_of_a_long_run() -> None:
    assert step_ticks(0, 1999, 6) == [0, 500, 1000, 1500]
    assert [step_label(t) for t in step_ticks(0, 2_500_000, 6)] == [
        "0",
        "500k",
        "1M",
        "1.5M",
        "2M",
        "2.5M",
    ]


def test_the_window_follows_the_run_pans_and_zooms() -> None:
    everything = StepWindow()
    assert everything.bounds(0, 999) == (0, 999)
    last = StepWindow(100)
    assert last.bounds(0, 999) == (899, 999)
    older = last.panned(-1, 0, 999)
    assert older.bounds(0, 999) == (874, 974)
    assert older.panned(1, 0, 999) == last  # back at the newest: it follows again
    assert last.panned(1, 0, 999) == last
    far = StepWindow(100, offset=10_000).panned(-1, 0, 999)
    assert far.bounds(0, 999) == (0, 100)  # never past the first step
    assert last.zoomed(0.5, 0, 999).bounds(0, 999) == (949, 999)
    assert everything.zoomed(0.5, 0, 999).size == 499
    assert last.zoomed(2, 0, 999).zoomed(2, 0, 999).zoomed(2, 0, 999).size == 800
    assert last.zoomed(16, 0, 999) == everything  # as wide as the run: all of it
    assert StepWindow(8).zoomed(0.5, 0, 999).size == 8  # zooming in stops


def bounds(values: np.ndarray, robust: bool, log: bool = False) -> tuple[float, float]:
    """y_range's limits where there are some."""
    limits = y_range(values, robust, log)
    assert limits is not None, values
    return limits


def test_the_robust_range_ignores_the_first_steps_and_keeps_the_newest() -> None:
    steps = np.arange(1000)
    loss = 0.2 + 10 * np.exp(-steps / 20)  # starts at 10, settles at 0.2
    lo, hi = bounds(loss, robust=True)
    assert hi < 0.5, "the first steps' loss does not set the top"
    assert lo < 0.2
    full_lo, full_hi = bounds(loss, robust=False)
    assert full_hi > 10 and full_lo < 0.2
    late_spike = loss.copy()
    late_spike[-3] = 5.0  # the newest quarter is always in range: a fresh spike shows
    assert bounds(late_spike, robust=True)[1] > 5.0


def test_y_range_ignores_non_finite_and_handles_flat_log_and_empty() -> None:
    assert y_range(np.array([np.nan, np.inf]), robust=True) is None
    lo, hi = bounds(np.array([2.0, 2.0, np.nan]), robust=True)
    assert lo < 2.0 < hi
    lo, hi = bounds(np.array([0.0, 1e-3, 1.0, 10.0]), robust=False, log=True)
    assert 0 < lo < 1e-3 and hi > 10.0


def test_first_nonfinite_tells_a_nan_loss_from_a_missing_one() -> None:
    steps = np.arange(10, 20)
    loss = np.array([np.nan, np.nan, 3.0, 2.0, 1.0, np.inf, np.nan, 1.0, 1.0, 1.0])
    assert first_nonfinite(steps, loss, None) == 15
    present = np.array([False, False, True, True, True, False, True, True, True, True])
    assert first_nonfinite(steps, loss, present) == 16
    assert first_nonfinite(steps, np.array([np.inf, *[1.0] * 9]), None) == 10
    assert first_nonfinite(steps, np.ones(10), None) is None


@pytest.mark.parametrize(
    ("lo", "hi", "most"), [(0.04, 1.35, 3), (0.05, 1.4, 5), (-2.5, 7.0, 6), (1e-3, 2e-3, 4)]
)
def test_value_ticks_are_round_and_as_many_as_fit(lo: float, hi: float, most: int) -> None:
    ticks = value_ticks(lo, hi, most)
    assert 2 <= len(ticks) <= most
    assert all(lo <= t <= hi for t in ticks)
    stride = ticks[1] - ticks[0]
    leading = stride / 10 ** math.floor(math.log10(stride))
    assert min(abs(leading - m) for m in (1, 2, 5)) < 1e-9
    assert value_ticks(0.04, 1.35, 3) == [0.5, 1.0]
    assert [value_label(t) for t in value_ticks(0.05, 1.4, 8)] == [
        "0.2",
        "0.4",
        "0.6",
        "0.8",
        "1",
        "1.2",
        "1.4",
    ]


def test_log_ticks_are_powers_of_ten_thinned_to_fit() -> None:
    assert log_ticks(0.01, 100, 10) == [0.01, 0.1, 1.0, 10.0, 100.0]
    assert log_ticks(0.009, 0.11, 10) == [0.01, 0.1]
    assert log_ticks(1e-12, 1e6, 5) == [1e-12, 1e-08, 0.0001, 1.0, 10000.0]  # every 4th decade
    assert log_ticks(1e-12, 1e6, 5)[0] == 1e-12
    # Within a decade (fewer than two powers of ten): round values, as on a linear axis.
    assert log_ticks(0.31, 0.9, 4) == value_ticks(0.31, 0.9, 4) == [0.4, 0.6, 0.8]
    assert log_ticks(0, 10, 5) == log_ticks(-1, 10, 5) == log_ticks(2, 1, 5) == []
    assert log_ticks(math.nan, 10, 5) == log_ticks(1, 10, 0) == []
