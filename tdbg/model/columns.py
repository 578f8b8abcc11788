"""A run's per-step columns as numpy: one ``steps`` message decoded, and the arrays that grow."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from tdbg.protocol.steps import FLAG_HAS_GRADS, FLAG_HAS_LOSS, step_columns


def _numpy(column: array) -> np.ndarray:
    """A decoded protocol column as numpy, its dtype the column's own typecode (no copy)."""
    return np.frombuffer(column, dtype=column.typecode)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One ``steps`` message as numpy arrays over protocol's decoded columns: the layout is
    protocol's (:func:`step_columns`), this only gives it numpy shapes."""

    n: int
    n_layers: int
    lr_groups: int
    steps: np.ndarray  # int, n
    has_loss: np.ndarray  # bool, n
    loss: np.ndarray  # n, NaN where there is no loss
    lr: np.ndarray  # n x lr_groups, NaN-padded past each row's lr_n
    lr_n: np.ndarray  # n: how many of a row's lr columns are real
    timings: dict[str, np.ndarray]  # F64_COLUMNS, n each
    has_grads: np.ndarray  # bool, n
    grad_total: np.ndarray  # one per row with grads
    grad_rows: np.ndarray  # rows with grads x n_layers

    @classmethod
    def decode(cls, msg: dict[str, Any]) -> StepBatch:
        """The batch in ``msg``; ProtocolError when its columns are malformed."""
        c = step_columns(msg)
        flags = _numpy(c.flags)
        has_loss = (flags & FLAG_HAS_LOSS).astype(bool)
        has_grads = (flags & FLAG_HAS_GRADS).astype(bool)
        return cls(
            n=c.n,
            n_layers=c.n_layers,
            lr_groups=c.lr_groups,
            steps=_numpy(c.step),
            has_loss=has_loss,
            loss=np.where(has_loss, _numpy(c.loss), np.nan),
            lr=_numpy(c.lr).reshape(c.n, c.lr_groups),
            lr_n=_numpy(c.lr_n),
            timings={name: _numpy(col) for name, col in c.timings.items()},
            has_grads=has_grads,
            grad_total=_numpy(c.grad_total),
            grad_rows=_numpy(c.grad_norms).reshape(int(has_grads.sum()), c.n_layers),
        )

    @property
    def grad_steps(self) -> np.ndarray:
        """The steps of the rows with per-layer norms, in ``grad_rows`` order."""
        return self.steps[self.has_grads]


class GrowArray:
    """An append-only numpy array that doubles its capacity: O(batch) appends, no Python objects."""

    def __init__(self, dtype: Any, width: int = 0, capacity: int = 1024) -> None:
        self.width = width
        shape = (capacity, width) if width else (capacity,)
        self._data = np.empty(shape, dtype=dtype)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    @property
    def values(self) -> np.ndarray:
        """A view of the filled part; valid until the next append."""
        return self._data[: self.n]

    def head(self, n: int) -> GrowArray:
        """The first ``n`` rows as a GrowArray over the same memory (nothing is copied). A view
        must never be extended: a replay state is rebuilt, never appended to."""
        view = GrowArray(self._data.dtype, self.width, capacity=0)
        view._data = self._data[:n]
        view.n = min(n, self.n)
        return view

    def widen(self, width: int, fill: float = math.nan) -> None:
        """Grow the column count (a run may add a param group); new columns get ``fill``."""
        if width <= self.width:
            return
        data = np.full((self._data.shape[0], width), fill, dtype=self._data.dtype)
        if self.width:
            data[:, : self.width] = self._data
        self._data = data
        self.width = width

    def extend(self, block: np.ndarray) -> None:
        k = block.shape[0]
        need = self.n + k
        if need > self._data.shape[0]:
            cap = max(need, 2 * self._data.shape[0])
            data = np.empty((cap, *self._data.shape[1:]), dtype=self._data.dtype)
            data[: self.n] = self._data[: self.n]
            self._data = data
        if self.width and block.ndim == 2 and block.shape[1] < self.width:
            self._data[self.n : need] = math.nan
            self._data[self.n : need, : block.shape[1]] = block
        else:
            self._data[self.n : need] = block
        self.n = need

    def compress(self, keep: np.ndarray) -> None:
        """Keep only the rows where ``keep`` is true (a mask over the filled part)."""
        kept = self._data[: self.n][keep]
        self._data[: len(kept)] = kept
        self.n = len(kept)


def thin_mask(n: int) -> np.ndarray:
    """Every row of the newer half; every other row of the older half."""
    keep = np.ones(n, dtype=bool)
    keep[1 : n // 2 : 2] = False
    return keep
