"""The inspect cursor's readings: every chart's value at one step (the latest at or before it)."""

from __future__ import annotations

import math

import numpy as np

from tdbg.model.metrics import MetricSeries
from tdbg.model.run_state import RunState


def _at_or_before(steps: np.ndarray, step: int) -> int:
    """The index of the last of ``steps`` (ascending) at or before ``step``; -1 when none."""
    return int(np.searchsorted(steps, step, side="right")) - 1


def snap(state: RunState, step: int) -> int | None:
    """The recorded step nearest ``step`` (the steps of a thinned history skip some)."""
    steps = state.steps.values
    if not len(steps):
        return None
    i = int(np.clip(np.searchsorted(steps, step), 0, len(steps) - 1))
    if i and abs(int(steps[i - 1]) - step) <= abs(int(steps[i]) - step):
        i -= 1
    return int(steps[i])


def moved(state: RunState, step: int, by: int) -> int | None:
    """The recorded step ``by`` steps from ``step`` (at least one recorded step away when
    there is one that way), kept within the run."""
    steps = state.steps.values
    if not len(steps):
        return None
    target = snap(state, step + by)
    if target == step and by:
        i = int(np.searchsorted(steps, step)) + (1 if by > 0 else -1)
        target = int(steps[min(max(i, 0), len(steps) - 1)])
    return target


def lr_at(state: RunState, step: int) -> list[float | None]:
    """Each param group's learning rate at ``step``."""
    i = _at_or_before(state.steps.values, step)
    if i < 0 or not state.lr_groups:
        return []
    row = state.lr.values[i, : int(state.lr_n.values[i])]
    return [float(v) if math.isfinite(v) else None for v in row]


def metric_at(series: MetricSeries, step: int) -> tuple[int, float] | None:
    """The metric's point at ``step`` or the last one before it (metrics come every N steps)."""
    steps, values = series.step_values
    i = _at_or_before(steps, step)
    return None if i < 0 else (int(steps[i]), float(values[i]))


def layer_norm_at(state: RunState, layer: int, step: int) -> tuple[int, float] | None:
    """A layer's gradient norm at ``step`` or the sampled step before it (norms are sampled
    every K steps; older rows thinned)."""
    steps, rows = state.grads.matrix()
    if not len(steps) or rows.ndim != 2 or not 0 <= layer < rows.shape[1]:
        return None
    order = np.argsort(steps, kind="stable")
    i = _at_or_before(steps[order], step)
    return None if i < 0 else (int(steps[order][i]), float(rows[order[i], layer]))


def step_time_at(state: RunState, step: int) -> float | None:
    """The step's time in seconds (None before the first step, or where it was not timed)."""
    i = _at_or_before(state.steps.values, step)
    if i < 0:
        return None
    value = float(state.cols["step_time"].values[i])
    return value if math.isfinite(value) else None


def total_norm_at(state: RunState, step: int) -> tuple[int, float] | None:
    """The total gradient norm at ``step`` or the sampled step before it."""
    steps = state.grad_steps.values
    i = _at_or_before(steps, step)
    return None if i < 0 else (int(steps[i]), float(state.grad_total.values[i]))
