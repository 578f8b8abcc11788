"""What a repaint reads of a run's whole step history, kept as rows arrive: loss, clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _last_finite(col: np.ndarray) -> int | None:
    """The index of the last finite value, or None. A column is most often finite at its end
    (or never finite): both answered without building an index array."""
    if not len(col):
        return None
    if math.isfinite(col[-1]):
        return len(col) - 1
    finite = np.isfinite(col)
    if not finite.any():
        return None
    return len(col) - 1 - int(finite[::-1].argmax())


class StepSummaries:
    """What a repaint reads of the whole step history, kept up to date as rows arrive so that
    no frame scans the history (at 2^18 steps the clipping figures alone took 25 ms a frame):
    the latest loss, where a trailing run of non-finite losses began, each column's latest
    finite value and the clipping counts. Counts cover every step seen, thinned ones too."""

    def __init__(self) -> None:
        self.last_loss: float | None = None
        self.nonfinite_since: int | None = None
        self.latest: dict[str, float] = {}
        self.clipping: Clipping | None = None

    def fold(
        self,
        steps: np.ndarray,
        has_loss: np.ndarray,
        loss: np.ndarray,
        cols: dict[str, np.ndarray],
    ) -> None:
        """Take in a block of new rows, oldest first. O(block)."""
        idx = np.flatnonzero(has_loss)
        if idx.size:
            losses = loss[idx]
            self.last_loss = float(losses[-1])
            finite = np.flatnonzero(np.isfinite(losses))
            if math.isfinite(self.last_loss):
                self.nonfinite_since = None
            elif finite.size:  # the trailing non-finite run began in this block
                self.nonfinite_since = int(steps[idx[finite[-1] + 1]])
            elif self.nonfinite_since is None:  # the whole block is non-finite: began here
                self.nonfinite_since = int(steps[idx[0]])
        for name, col in cols.items():
            i = _last_finite(col)
            if i is not None:
                self.latest[name] = float(col[i])
        self._fold_clipping(steps, cols.get("clip_max"), cols.get("clip_norm"))

    def _fold_clipping(
        self, steps: np.ndarray, cmax: np.ndarray | None, cnorm: np.ndarray | None
    ) -> None:
        if cmax is None or cnorm is None:
            return
        idx = np.flatnonzero(np.isfinite(cmax) & ~np.isnan(cnorm))
        if not idx.size:
            return
        before = self.clipping
        last = int(idx[-1])
        self.clipping = Clipping(
            max_norm=float(cmax[last]),
            last_norm=float(cnorm[last]),
            last_step=int(steps[last]),
            steps=int(idx.size) + (before.steps if before else 0),
            active=int((cnorm[idx] > cmax[idx]).sum()) + (before.active if before else 0),
        )


@dataclass(frozen=True, slots=True)
class Clipping:
    """``clip_grad_norm_`` over the steps that report it."""

    max_norm: float  # the latest step's max_norm
    last_norm: float  # the total norm it measured, before clipping
    last_step: int
    steps: int  # steps that report a clip
    active: int  # of them, steps where the measured norm exceeded max_norm

    @property
    def active_share(self) -> float:
        return self.active / self.steps if self.steps else 0.0
