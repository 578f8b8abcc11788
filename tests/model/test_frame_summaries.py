"""RunState's per-frame figures are kept as rows arrive (no frame rescans the history): they
match a scan of the history, count thinned steps too, and follow a replay cursor."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tdbg.model.run_state import RunState
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.sources.synthetic import RUN


def record(step: int, loss: float | None, **columns: Any) -> StepRecord:
    return StepRecord(step=step, time=float(step), loss=loss, step_time=1.0, **columns)


def test_nonfinite_since_names_the_first_step_of_the_trailing_run() -> None:
    state = RunState(dict(RUN))
    assert state.nonfinite_since is None
    state.apply(pack_steps([record(0, 1.0), record(1, 0.9), record(2, math.nan)], 0))
    assert state.nonfinite_since == 2
    # A batch that is all non-finite (and a step with no loss) keeps where the run began.
    state.apply(pack_steps([record(3, math.inf), record(4, None), record(5, math.nan)], 0))
    assert state.nonfinite_since == 2
    assert state.last_loss is not None and math.isnan(state.last_loss)
    state.apply(pack_steps([record(6, 0.8), record(7, math.nan), record(8, math.nan)], 0))
    assert state.nonfinite_since == 7
    state.apply(pack_steps([record(9, 0.7)], 0))
    assert state.nonfinite_since is None and state.last_loss == 0.7


def test_clipping_counts_every_step_seen_thinned_ones_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import tdbg.model.run_state as model

    monkeypatch.setattr(model, "MAX_SCALAR_ROWS", 100)
    state = RunState(dict(RUN))
    for start in range(0, 1000, 50):
        batch = [record(s, 1.0, clip_max=1.0, clip_norm=2.0 if s % 4 == 0 else 0.5) for s in
                 range(start, start + 50)]  # fmt: skip
        state.apply(pack_steps(batch, 0))
    assert state.thinned_steps > 0
    clip = state.clipping()
    assert clip is not None
    assert (clip.steps, clip.active, clip.last_step) == (1000, 250, 999)
    assert clip.active_share == 0.25


def test_latest_column_values_survive_steps_that_do_not_report_them() -> None:
    state = RunState(dict(RUN))
    state.apply(pack_steps([record(0, 1.0, epoch=3.0, micro_batches=4.0)], 0))
    state.apply(pack_steps([record(s, 1.0) for s in range(1, 200)], 0))
    assert state.epoch == 3.0 and state.micro_batches == 4.0
    state.apply(pack_steps([record(200, 1.0, epoch=4.0)], 0))
    assert state.epoch == 4.0


def test_anatomy_follows_new_steps() -> None:
    state = RunState(dict(RUN))
    state.apply(pack_steps([record(0, 1.0, data_time=0.1)], 0))
    assert state.anatomy()["data_time"] == 0.1 and not state.input_bound
    slow_input = [record(s, 1.0, data_time=0.9) for s in range(1, 100)]
    state.apply(pack_steps(slow_input, 0))
    assert state.anatomy()["data_time"] == 0.9 and state.input_bound


def test_anatomy_reads_the_recent_steps_whose_phases_were_timed() -> None:
    """A GPU run with short steps times the phases of one step in a few (the others' phase
    columns NaN): the bar is the mean over the last ANATOMY_WINDOW timed steps, found as far
    back as they are, not over the two or three among the last ANATOMY_WINDOW steps."""
    from tdbg.model.run_state import ANATOMY_WINDOW
    from tdbg.protocol.steps import MAX_PHASE_GAP

    state = RunState(dict(RUN))
    stride = MAX_PHASE_GAP // 2  # one step in 16 timed: 25 of 400, input wait 0.00, 0.01, ...
    timed = range(0, 400, stride)
    state.apply(pack_steps([
        record(s, 1.0, data_time=0.01 * (s // stride), forward_time=0.5)
        if s in timed else record(s, 1.0)
        for s in range(400)
    ], 0))  # fmt: skip
    assert len(timed) < ANATOMY_WINDOW
    shares = state.anatomy()
    assert shares["data_time"] == pytest.approx(0.12)  # the mean of 0.00 ... 0.24
    assert shares["forward_time"] == pytest.approx(0.5)
    assert shares["backward_time"] is None  # never measured
    assert state.mean_recent("data_time") == pytest.approx(0.12)


def test_a_replay_cursor_reads_the_figures_of_its_step() -> None:
    records = [record(0, 1.0, clip_max=1.0, clip_norm=2.0, epoch=0.0)]
    records += [record(s, 0.5, clip_max=1.0, clip_norm=0.5) for s in range(1, 10)]
    records += [record(10, math.nan, epoch=1.0), record(11, math.nan)]
    full = RunState(dict(RUN))
    full.apply(pack_steps(records, 0))
    for n in (1, 5, 11, 12):
        live = RunState(dict(RUN))
        live.apply(pack_steps(records[:n], 0))
        cursor = RunState(dict(RUN))
        cursor.share_head(full, n)
        assert cursor.clipping() == live.clipping()
        assert cursor.nonfinite_since == live.nonfinite_since
        assert cursor.epoch == live.epoch
        assert cursor.anatomy() == live.anatomy()
        assert np.isnan(cursor.last_loss or 0.0) == np.isnan(live.last_loss or 0.0)
