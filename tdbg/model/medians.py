"""Medians of a rank's few recent values, equal to numpy's to the bit, without its overhead."""

from __future__ import annotations

import numpy as np


def median(values: np.ndarray) -> float:
    """``float(np.median(values))`` for a non-empty 1-D array of finite values. np.median costs
    ~30 µs on 20 values (dispatch, partition, mean); a node's bridge reads 7 a rank twice a
    second. Same value: the middle one, or the two middle ones added and halved as np.mean
    halves them."""
    ordered = np.sort(values)
    mid = ordered.size // 2
    if ordered.size % 2:
        return float(ordered[mid])
    return float((ordered[mid - 1] + ordered[mid]) / 2)


def row_medians(table: np.ndarray) -> np.ndarray:
    """Each row's median of its values other than NaN (a row is values and NaN padding), NaN
    for a row of NaN only: ``np.nanmedian(table, axis=1)`` without its masked-array path (which
    imports numpy.ma, ~70 ms, on first use and costs ~0.5 ms a call)."""
    rows = np.arange(table.shape[0])
    if not table.shape[1]:
        return np.full(table.shape[0], np.nan)
    ordered = np.sort(table, axis=1)  # NaN sorts last
    counts = (~np.isnan(table)).sum(axis=1)
    lo = ordered[rows, np.maximum(counts - 1, 0) // 2]
    hi = ordered[rows, np.minimum(counts // 2, table.shape[1] - 1)]
    with np.errstate(invalid="ignore"):
        out = np.where(counts % 2 == 1, lo, (lo + hi) / 2)
    out[counts == 0] = np.nan
    return out


__all__ = ["median", "row_medians"]
