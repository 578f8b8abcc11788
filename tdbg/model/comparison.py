"""Runs side by side: which is ahead, where their loss curves part beyond their noise, which layers'
gradients differ most, and what differs in how they were started. Read from RunStates only."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tdbg.format import finite_tree
from tdbg.model.diagnosis import loss_figures, median_of, run_phases, steps_per_second
from tdbg.model.overlays import CHART_POINTS, Overlay, overlays
from tdbg.model.run_state import RunState

PART_WINDOW = 20  # steps a curve's noise is measured over (its rolling standard deviation)
PART_SIGMAS = 3.0  # curves part where their smoothed gap exceeds this many noises...
PART_HOLD = 10  # ...for this many common steps in a row (one spike is no parting)
TOP_LAYERS = 5
AXES = ("step", "time")


@dataclass(frozen=True)
class RunSummary:
    """One run's figures in a comparison."""

    name: str
    source: str  # the recording's path or the socket as given
    steps: int
    last_step: int | None
    loss_final: float | None  # the smoothed loss at its last step
    loss_best: float | None
    loss_best_step: int | None
    steps_per_sec: float | None
    step_time: float | None  # median seconds
    phases: dict[str, float | None]
    metrics_final: dict[str, float]  # each logged metric's latest value


@dataclass(frozen=True)
class Comparison:
    """Everything ``tdbg compare`` says."""

    runs: list[RunSummary]
    axis: str  # "step" (the runs share steps) or "time" (they do not: compared by elapsed time)
    common: tuple[float, float] | None  # the shared range of that axis
    ahead: (
        int | None
    )  # index of the run with the lowest smoothed loss at the end of the shared range
    ahead_by: float | None  # its loss lower than the next best's by this much, there
    parted_at: float | None  # first step (or second) where the first two curves part
    layers: list[tuple[str, float]]  # layers whose gradient norms differ most (log10 ratio B/A)
    started: dict[str, list[Any]]  # what differs in how they were started, per field, per run
    charts: list[list[float]]  # each run's smoothed loss over the shared range, CHART_POINTS
    # Every other series two runs or more have (lr, step time, gradient norm, each metric),
    # each on its own grid of the axis, and the series not every run has (name -> runs having it).
    overlays: list[Overlay] = field(default_factory=list)
    only_in: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # why something could not be compared

    def to_json(self) -> dict[str, Any]:
        return finite_tree(asdict(self))


def compare(states: list[RunState], sources: list[str], by: str | None = None) -> Comparison:
    """Compare two or more runs (the first two for the parting point and the layers) by step,
    by the time since each started (``by="time"``), or by step unless they share none
    (``by=None``)."""
    notes: list[str] = []
    axis = by or "step"
    curves = [_curve(s, axis) for s in states]
    common = _common(curves)
    lossless = [i for i, (x, _) in enumerate(curves) if len(x) < 2]
    if lossless:  # no curve to compare, whatever the steps: say so, not "no shared steps"
        letters = ", ".join(chr(ord("A") + i) for i in lossless)
        notes.append(f"no finite loss to compare in run {letters}")
    elif common is None and by is None:
        curves = [_curve(s, "time") for s in states]
        common = _common(curves)
        axis = "time"
        notes.append("the runs share no steps: compared by time since each started")
    elif common is None and by == "step":
        notes.append("the runs share no steps with losses (--by time compares them by time)")
    elif common is None:
        notes.append("the runs share no stretch of time with losses")
    if common is None and not lossless and by is None:
        notes.append("the runs share neither steps nor a stretch of time with losses")
    ahead, ahead_by, charts = None, None, []
    parted = None
    if common is not None:
        lo, hi = common
        grid = np.linspace(lo, hi, CHART_POINTS)
        charts = [_on_grid(x, y, grid) for x, y in curves]
        ends = [c[-1] if c else math.nan for c in charts]
        ranked = sorted((v, i) for i, v in enumerate(ends) if math.isfinite(v))
        if ranked:
            ahead = ranked[0][1]
            ahead_by = ranked[1][0] - ranked[0][0] if len(ranked) > 1 else None
        parted = _parted(curves[0], curves[1], lo, hi)
    charted, only_in = overlays(states, axis)
    return Comparison(
        runs=[_summary(s, src) for s, src in zip(states, sources, strict=True)],
        axis=axis,
        common=common,
        ahead=ahead,
        ahead_by=ahead_by,
        parted_at=parted,
        layers=_layers(states[0], states[1]),
        started=_started(states),
        charts=charts,
        overlays=charted,
        only_in=only_in,
        notes=notes,
    )


def _curve(state: RunState, axis: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, smoothed loss) over the steps with a finite smoothed loss; x is the step or the
    seconds since the run started."""
    ema = state.loss_ema.values
    ok = np.isfinite(ema)
    if axis == "step":
        x = state.steps.values.astype(np.float64)
    else:
        start = state.run.get("start_time")
        t = state.cols["time"].values
        x = t - (float(start) if isinstance(start, int | float) else (t[0] if len(t) else 0.0))
    return x[ok], ema[ok]


def _common(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float] | None:
    if any(len(x) < 2 for x, _ in curves):
        return None
    lo = max(float(x[0]) for x, _ in curves)
    hi = min(float(x[-1]) for x, _ in curves)
    return (lo, hi) if hi > lo else None


def _on_grid(x: np.ndarray, y: np.ndarray, grid: np.ndarray) -> list[float]:
    return [float(v) for v in np.interp(grid, x, y)]


def _noise(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A curve's local noise: the rolling standard deviation of its step-to-step changes."""
    diffs = np.abs(np.diff(y, prepend=y[0]))
    kernel = np.ones(PART_WINDOW) / PART_WINDOW
    return np.convolve(diffs, kernel, mode="same")


def _parted(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], lo: float, hi: float
) -> float | None:
    """The first x in [lo, hi] from which the two smoothed curves stay apart by more than
    PART_SIGMAS of their noise for PART_HOLD points in a row."""
    xs = a[0][(a[0] >= lo) & (a[0] <= hi)]
    if len(xs) < PART_HOLD:
        return None
    ya = np.interp(xs, *a)
    yb = np.interp(xs, *b)
    noise = np.interp(xs, a[0], _noise(*a)) + np.interp(xs, b[0], _noise(*b))
    apart = np.abs(ya - yb) > PART_SIGMAS * np.maximum(noise, 1e-12)
    run = 0
    for i, flag in enumerate(apart):
        run = run + 1 if flag else 0
        if run >= PART_HOLD:
            return float(xs[i - PART_HOLD + 1])
    return None


def _layers(a: RunState, b: RunState) -> list[tuple[str, float]]:
    """Layers both runs have, by how far apart their median gradient norms are (log10 B/A)."""
    shared = [n for n in a.layer_names if n in set(b.layer_names)]
    if not shared:
        return []
    med_a = _median_norms(a)
    med_b = _median_norms(b)
    out = []
    for name in shared:
        va, vb = med_a.get(name), med_b.get(name)
        if va and vb and va > 0 and vb > 0:
            out.append((name, math.log10(vb / va)))
    return sorted(out, key=lambda kv: -abs(kv[1]))[:TOP_LAYERS]


def _median_norms(state: RunState) -> dict[str, float]:
    _, rows = state.grads.matrix()
    if not len(rows):
        return {}
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(rows), rows, np.nan)
        med: Any = np.nanmedian(finite, axis=0) if np.isfinite(finite).any() else []
    return {
        name: float(v)
        for name, v in zip(state.layer_names, med, strict=False)
        if math.isfinite(float(v))
    }


STARTED_FIELDS = ("argv", "torch", "device", "world_size", "optimizers", "first_lr", "models")


def _started(states: list[RunState]) -> dict[str, list[Any]]:
    """The fields of how each run was started that are not the same for all of them."""
    rows = []
    for s in states:
        lr = s.lr.values[0, : int(s.lr_n.values[0])].tolist() if s.n_steps and s.lr_groups else []
        rows.append(
            {
                "argv": " ".join(map(str, s.run.get("argv") or [])),
                "torch": s.run.get("torch"),
                "device": s.run.get("device"),
                "world_size": s.run.get("world_size"),
                "optimizers": ", ".join(f"{n}: {t}" for n, t, _ in s.optimizers),
                "first_lr": [float(v) for v in lr],
                "models": ", ".join(s.models),
            }
        )
    return {
        key: [row[key] for row in rows]
        for key in STARTED_FIELDS
        if len({repr(row[key]) for row in rows}) > 1
    }


def _summary(state: RunState, source: str) -> RunSummary:
    """One run's figures, computed as ``tdbg report`` computes them (tdbg.model.diagnosis)."""
    ema = state.loss_ema.values
    finite = np.flatnonzero(np.isfinite(ema))
    _, best, best_step, _ = loss_figures(state)
    return RunSummary(
        name=str(state.run.get("name") or "?"),
        source=source,
        steps=state.n_steps,
        last_step=state.last_step,
        loss_final=float(ema[finite[-1]]) if finite.size else None,
        loss_best=best,
        loss_best_step=best_step,
        steps_per_sec=steps_per_second(state.steps.values, state.cols["time"].values),
        step_time=median_of(state.cols["step_time"].values),
        phases=run_phases(state),
        metrics_final=_metrics_final(state),
    )


def _metrics_final(state: RunState) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, series in state.metrics.series.items():
        _, values = series.step_values
        if len(values):
            out[name] = float(values[-1])
    return out
