"""Each series several runs share — learning rate, step time, gradient norm, every logged metric —
on one grid of the axis they are compared by (step or seconds since each started), for charts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tdbg.model.run_state import RunState

CHART_POINTS = 60
# The run's own series first, in this order, then the logged metrics by name.
LR, STEP_TIME, GRAD_NORM = "lr", "step_time", "grad_norm"


@dataclass(frozen=True)
class Overlay:
    """One series of several runs on one grid: ``span`` the stretch of the axis they share,
    ``x`` the grid's points in it (steps or seconds), ``series`` one list of values per run
    (None for a run that does not have it): each point the median of the run's values around
    it; ``last`` each run's value at the end of the span (read off its points, not a median)."""

    name: str
    span: tuple[float, float]
    x: list[float]
    series: list[list[float] | None]
    last: list[float | None]


Points = tuple[np.ndarray, np.ndarray]  # (step, value), oldest first


def run_series(state: RunState) -> dict[str, Points]:
    """A run's series by name: learning rate per group (``lr``, ``lr group 1``, ...), step time,
    total gradient norm and each logged metric, as (step, value) points."""
    steps = state.steps.values
    out: dict[str, Points] = {}
    lr = state.lr.values
    for g in range(state.lr_groups):
        out[LR if g == 0 else f"lr group {g}"] = (steps, lr[:, g])
    out[STEP_TIME] = (steps, state.cols["step_time"].values)
    out[GRAD_NORM] = (state.grad_steps.values, state.grad_total.values)
    for name in sorted(state.metrics.series):
        if name in out:  # a metric named like one of ours: kept apart, not mixed in
            out[f"metric {name}"] = state.metrics.series[name].step_values
        else:
            out[name] = state.metrics.series[name].step_values
    return {name: pts for name, pts in out.items() if np.isfinite(pts[1]).sum() >= 1}


def elapsed_at(state: RunState, steps: np.ndarray) -> np.ndarray:
    """Seconds since the run started at each of ``steps`` (read off its steps' clock), so a
    metric logged by step can be compared by time."""
    t = state.cols["time"].values
    start = state.run.get("start_time")
    origin = float(start) if isinstance(start, int | float) else (float(t[0]) if len(t) else 0.0)
    own = state.steps.values.astype(np.float64)
    if len(own) < 2:
        return np.full(len(steps), math.nan)
    return np.interp(steps.astype(np.float64), own, t - origin)


def overlays(states: list[RunState], axis: str) -> tuple[list[Overlay], dict[str, list[int]]]:
    """Every series at least two runs have, over the stretch of ``axis`` those runs share, and
    the series not every run has (name -> the indices of the runs that do)."""
    per_run = [run_series(s) for s in states]
    names: list[str] = []
    for series in per_run:
        names += [n for n in series if n not in names]
    ordered = [n for n in (LR, STEP_TIME, GRAD_NORM) if n in names]
    ordered += [n for n in names if n.startswith("lr group ")]
    ordered += sorted(n for n in names if n not in ordered)
    charts: list[Overlay] = []
    only_in: dict[str, list[int]] = {}
    for name in ordered:
        having = [i for i, series in enumerate(per_run) if name in series]
        if len(having) < len(states):
            only_in[name] = having
        if len(having) < 2:
            continue
        curves = {}
        for i in having:
            steps, values = per_run[i][name]
            ok = np.isfinite(values)
            x = steps.astype(np.float64) if axis == "step" else elapsed_at(states[i], steps)
            ok &= np.isfinite(x)
            curves[i] = (x[ok], values[ok])
        chart = _overlay(name, curves, len(states))
        if chart is not None:
            charts.append(chart)
    return charts, only_in


def _overlay(name: str, curves: dict[int, Points], n_runs: int) -> Overlay | None:
    """The curves on one grid over the stretch they all cover; None when they share none (a
    metric logged once, or at steps that do not overlap)."""
    if any(len(x) < 2 for x, _ in curves.values()):
        return None
    lo = max(float(x.min()) for x, _ in curves.values())
    hi = min(float(x.max()) for x, _ in curves.values())
    if not hi > lo:
        return None
    edges = np.linspace(lo, hi, CHART_POINTS + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    series: list[list[float] | None] = [None] * n_runs
    last: list[float | None] = [None] * n_runs
    for i, (x, y) in curves.items():
        series[i] = binned(x, y, edges)
        order = np.argsort(x, kind="stable")
        last[i] = float(np.interp(hi, x[order], y[order]))
    return Overlay(name, (lo, hi), [float(c) for c in centres], series, last)


def binned(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> list[float]:
    """The median of the points in each bin between ``edges`` (a noisy step time reads as its
    typical value, not whichever step fell on a grid point); a bin with no point (a metric
    logged every 500 steps) is read off the line between its neighbours."""
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    n = len(edges) - 1
    out = np.interp((edges[:-1] + edges[1:]) / 2, x, y)
    bounds = np.searchsorted(x, edges, side="left")
    bounds[-1] = np.searchsorted(x, edges[-1], side="right")  # the last bin holds its end
    for k in range(n):
        if bounds[k + 1] > bounds[k]:
            out[k] = float(np.median(y[bounds[k] : bounds[k + 1]]))
    return [float(v) for v in out]
