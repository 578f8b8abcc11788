"""MetricStore: user metrics (``tdbg.log``, framework logs, ``loss/NAME``) as bounded series.

Each name keeps its points (step, value) in numpy arrays; past :data:`MAX_POINTS` the older half
is thinned to every other point, so a long run costs bounded memory while the recent points stay
exact. The latest value, its step and the min / max over the finite values (a NaN is kept and
counted, never folded into min / max) are kept as points arrive, so a repaint reads them in O(1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

MAX_POINTS = 8192  # per metric; the older half is thinned past this
MAX_NAMES = 512  # the probe caps names itself (256); a hostile stream cannot grow this further

_LOSS_LIKE = re.compile(r"(^|[/_.\-])loss($|[/_.\-])|^loss", re.IGNORECASE)


def loss_like(name: str) -> bool:
    """A metric that belongs with the loss chart: ``val_loss``, ``eval_loss``, ``loss/netG``,
    ``train/loss``; not ``lossless_acc``."""
    return bool(_LOSS_LIKE.search(name)) and not name.lower().startswith("lossless")


@dataclass
class MetricSeries:
    """One metric's points, oldest first."""

    name: str
    steps: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    values: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    n: int = 0
    lo: float = math.nan  # min over finite values (NaN when none)
    hi: float = math.nan
    nonfinite: int = 0  # non-finite points seen (thinned ones included)
    count: int = 0  # points seen (thinned ones included)

    @property
    def step_values(self) -> tuple[np.ndarray, np.ndarray]:
        return self.steps[: self.n], self.values[: self.n]

    @property
    def last_step(self) -> int | None:
        return int(self.steps[self.n - 1]) if self.n else None

    @property
    def last(self) -> float | None:
        return float(self.values[self.n - 1]) if self.n else None

    def extend(self, steps: list[int], values: list[float]) -> None:
        k = len(steps)
        need = self.n + k
        if need > len(self.steps):
            cap = max(need, 2 * len(self.steps), 16)
            s = np.empty(cap, np.int64)
            v = np.empty(cap, np.float64)
            s[: self.n], v[: self.n] = self.steps[: self.n], self.values[: self.n]
            self.steps, self.values = s, v
        block = np.asarray(values, dtype=np.float64)
        self.steps[self.n : need] = steps
        self.values[self.n : need] = block
        self.n = need
        self.count += k
        finite = block[np.isfinite(block)]
        self.nonfinite += k - int(finite.size)
        if finite.size:
            lo, hi = float(finite.min()), float(finite.max())
            self.lo = lo if math.isnan(self.lo) else min(self.lo, lo)
            self.hi = hi if math.isnan(self.hi) else max(self.hi, hi)
        while self.n > MAX_POINTS:
            keep = np.ones(self.n, dtype=bool)
            keep[1 : self.n // 2 : 2] = False
            kept = int(keep.sum())
            self.steps[:kept] = self.steps[: self.n][keep]
            self.values[:kept] = self.values[: self.n][keep]
            self.n = kept

    def until(self, step: int) -> MetricSeries:
        """The points at or before ``step`` (a replay cursor), as a new series."""
        k = int(np.searchsorted(self.steps[: self.n], step, side="right"))
        out = MetricSeries(self.name)
        if k:
            out.extend(self.steps[:k].tolist(), self.values[:k].tolist())
        return out


class MetricStore:
    """Every metric of a run by name, in the order they first arrived."""

    def __init__(self) -> None:
        self.series: dict[str, MetricSeries] = {}
        self.dropped_names = 0  # points whose name came past MAX_NAMES
        self.revision = 0

    def __len__(self) -> int:
        return len(self.series)

    def __contains__(self, name: object) -> bool:
        return name in self.series

    def __getitem__(self, name: str) -> MetricSeries:
        return self.series[name]

    @property
    def names(self) -> list[str]:
        return list(self.series)

    def add(self, points: Iterable[tuple[int, str, float]]) -> None:
        """Fold ``(step, name, value)`` points (as ``read_metrics`` gives them) in."""
        grouped: dict[str, tuple[list[int], list[float]]] = {}
        for step, name, value in points:
            if (
                name not in self.series
                and name not in grouped
                and len(self.series) + len(grouped) >= MAX_NAMES
            ):
                self.dropped_names += 1
                continue
            steps, values = grouped.setdefault(name, ([], []))
            steps.append(step)
            values.append(value)
        for name, (steps, values) in grouped.items():
            series = self.series.get(name)
            if series is None:
                series = self.series[name] = MetricSeries(name)
            series.extend(steps, values)
        if grouped:
            self.revision += 1

    def loss_like(self) -> list[MetricSeries]:
        return [s for name, s in self.series.items() if loss_like(name)]

    def others(self) -> list[MetricSeries]:
        return [s for name, s in self.series.items() if not loss_like(name)]

    def until(self, step: int) -> MetricStore:
        """The metrics as they stood at ``step`` (a replay cursor)."""
        out = MetricStore()
        for name, series in self.series.items():
            head = series.until(step)
            if head.n:
                out.series[name] = head
        out.revision = 1
        return out
