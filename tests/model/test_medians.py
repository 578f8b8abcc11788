"""The bridge's medians equal numpy's to the bit: a rank's few recent values, and a table's rows
(NaN padding) as np.nanmedian reads them."""

from __future__ import annotations

import warnings

import numpy as np

from tdbg.model.medians import median, row_medians


def test_median_is_numpys_for_odd_and_even_counts() -> None:
    rng = np.random.default_rng(0)
    for n in range(1, 41):
        for scale in (1e-3, 1.0, 1e6):
            values = rng.normal(size=n) * scale
            if n % 3 == 0:
                values = np.round(values, 1)  # ties
            assert median(values) == float(np.median(values))


def test_row_medians_are_nanmedians_with_padding_and_empty_rows() -> None:
    rng = np.random.default_rng(1)
    for _ in range(500):
        rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 25))
        table = rng.normal(size=(rows, width))
        table[rng.random((rows, width)) < 0.4] = np.nan
        table[0, :] = np.nan  # a row with nothing measured
        if width > 2:
            table[-1, 1] = np.inf  # a value numpy counts, not padding
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            expected = np.nanmedian(table, axis=1)
        assert np.array_equal(row_medians(table), expected, equal_nan=True)
    assert row_medians(np.empty((3, 0))).shape == (3,)
