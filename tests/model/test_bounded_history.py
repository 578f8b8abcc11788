"""RunState's bounded histories keep their promises: even thinning, replay's from_rows, steps/s."""

from __future__ import annotations

import numpy as np
import pytest

from tdbg.model.columns import thin_mask
from tdbg.model.grad_history import GradHistory
from tdbg.model.run_state import RATE_WINDOW, RunState
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.sources.synthetic import RUN


def rows_for(steps: np.ndarray, n_layers: int = 3) -> np.ndarray:
    """Rows whose every value is its own step, so a row shows where it came from."""
    return np.tile(steps[:, None], (1, n_layers)).astype(np.float32)


def fed(total: int, batches: list[int], recent: int = 32, old: int = 16) -> GradHistory:
    history = GradHistory(3, recent=recent, old=old)
    start = 0
    i = 0
    while start < total:
        k = min(batches[i % len(batches)], total - start)
        steps = np.arange(start, start + k)
        history.extend(steps, rows_for(steps))
        start += k
        i += 1
    return history


def assert_evenly_thinned(history: GradHistory, total: int, recent: int) -> None:
    steps, rows = history.matrix()
    np.testing.assert_array_equal(rows[:, 0], steps)  # each row is still its own step's
    kept_recent = min(total, recent)
    tail = steps[len(steps) - kept_recent :]
    np.testing.assert_array_equal(tail, np.arange(total - kept_recent, total))
    old = steps[: len(steps) - kept_recent]
    if len(old) > 1:
        # The old rows are one in ``stride``, evenly spaced: no clumps, no holes.
        assert set(np.diff(old).tolist()) == {history.stride}, np.diff(old)
    if len(old):
        assert old[0] == 0  # the start of the run survives
        assert 0 < tail[0] - old[-1] <= history.stride  # and no hole before the recent rows


@pytest.mark.parametrize("total", [10, 33, 48, 100, 257, 1000, 5000])
@pytest.mark.parametrize("batches", [[1], [7], [5, 64, 3], [200]])
def test_thinned_gradient_rows_are_evenly_spaced(total: int, batches: list[int]) -> None:
    history = fed(total, batches)
    assert len(history) <= 32 + 16
    assert_evenly_thinned(history, total, recent=32)


@pytest.mark.parametrize("total", [0, 1, 31, 32, 33, 48, 49, 100, 1000, 5000])
def test_from_rows_keeps_what_extend_keeps(total: int) -> None:
    steps = np.arange(total)
    built = GradHistory.from_rows(3, steps, rows_for(steps), recent=32, old=16)
    assert built.total_rows == total and len(built) <= 32 + 16
    assert_evenly_thinned(built, total, recent=32)
    grown = fed(total, [1])
    # The same resolution as a live history of the same rows: a replay cursor shows what the
    # live screen showed (the phase of the thinning may differ, the density may not).
    assert built.stride == grown.stride
    assert len(built) == pytest.approx(len(grown), abs=1)
    if total:
        assert built.latest_step() == total - 1
        np.testing.assert_array_equal(built.recent(5), grown.recent(5))


def test_thin_mask_halves_only_the_older_half() -> None:
    for n in (2, 3, 10, 11, 1000):
        keep = thin_mask(n)
        kept = np.flatnonzero(keep)
        older, newer = kept[kept < n // 2], kept[kept >= n // 2]
        np.testing.assert_array_equal(newer, np.arange(n // 2, n))
        assert set(np.diff(older).tolist()) <= {2}
        assert kept[0] == 0


def run_at(rates: list[tuple[int, float]]) -> RunState:
    """A state whose steps came at ``rates``: (steps, steps per second) spans in order."""
    records = []
    step, t = 0, 1000.0
    for n, per_second in rates:
        for _ in range(n):
            records.append(StepRecord(step=step, time=t, loss=1.0))
            step += 1
            t += 1.0 / per_second
    state = RunState(dict(RUN))
    state.apply(pack_steps(records, 0))
    return state


def test_steps_per_second_is_a_recent_window() -> None:
    # 100 slow steps (1/s), then 20 s at 10 steps/s: the rate now is 10, the run's mean ~2.6.
    state = run_at([(100, 1.0), (200, 10.0)])
    assert state.steps_per_sec() == pytest.approx(10.0, rel=0.05)
    # And the other way round: a run that slowed down reads slow, however fast it once was.
    state = run_at([(1000, 100.0), (30, 2.0)])
    assert state.steps_per_sec() == pytest.approx(2.0, rel=0.05)


def test_steps_per_second_with_fewer_steps_than_the_window() -> None:
    assert run_at([(1, 5.0)]).steps_per_sec() is None
    state = run_at([(3, 4.0)])  # half a second of steps, well inside the window
    assert RATE_WINDOW > 1
    assert state.steps_per_sec() == pytest.approx(4.0)
