"""RunState: histories, bounded gradient history, alerts, derived figures — no textual involved."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tdbg.format import fmt, fmt_bytes, fmt_loss
from tdbg.model.grad_history import GradHistory
from tdbg.model.run_state import MAX_ALERTS, RunState
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.sources.synthetic import RUN, layer_names, step_records, synthetic_run


def state_with(steps: int = 100, layers: int = 4, **kwargs: object) -> RunState:
    state = RunState(dict(RUN))
    state.apply_many(synthetic_run(steps=steps, n_layers=layers, **kwargs))  # type: ignore[arg-type]
    return state


def test_histories_match_the_records() -> None:
    records = step_records(0, 120, 3)
    state = RunState(dict(RUN))
    state.apply({"type": "layers", "names": layer_names(3), "numel": [1, 2, 3]})
    state.apply(pack_steps(records[:70], 3))
    state.apply(pack_steps(records[70:], 3))
    assert state.n_steps == 120
    assert state.last_step == 119
    np.testing.assert_allclose(state.loss.values, [r.loss or 0.0 for r in records])
    np.testing.assert_array_equal(state.steps.values, np.arange(120))
    assert state.lr_groups == 2
    assert state.latest_lr() == [records[-1].lr[0], records[-1].lr[1]]
    latest = state.grads.latest()
    assert latest is not None and records[-1].grad_norms is not None
    np.testing.assert_allclose(latest, np.asarray(records[-1].grad_norms, dtype=np.float32))
    assert state.grads.latest_step() == 119
    assert len(state.grad_total) == 120
    assert state.smoothed_loss is not None and 0 < state.smoothed_loss < 3


def test_missing_loss_is_none_and_nan_loss_means_diverged() -> None:
    state = RunState(dict(RUN))
    state.apply(pack_steps([StepRecord(step=0, time=1.0)], 0))
    assert state.last_loss is None
    assert fmt(state.mean_recent("data_time")) == "n/a"
    assert state.anatomy()["data_time"] is None
    assert not state.input_bound
    assert not state.diverged
    state.apply(pack_steps([StepRecord(step=1, time=2.0, loss=math.nan)], 0))
    assert state.diverged
    assert fmt_loss(state.last_loss) == "NaN"
    # One NaN does not poison the smoothed loss.
    state.apply(pack_steps([StepRecord(step=2, time=3.0, loss=1.5)], 0))
    assert state.smoothed_loss == 1.5
    assert not state.diverged


def test_lr_groups_may_grow() -> None:
    state = RunState(dict(RUN))
    state.apply(pack_steps([StepRecord(step=0, time=0.0, loss=1.0, lr=[0.1])], 0))
    state.apply(pack_steps([StepRecord(step=1, time=1.0, loss=1.0, lr=[0.1, 0.2, 0.3])], 0))
    assert state.lr_groups == 3
    assert state.lr.values.shape == (2, 3)
    assert math.isnan(state.lr.values[0, 2])
    assert state.latest_lr() == [0.1, 0.2, 0.3]


def test_grad_history_is_bounded_and_ordered() -> None:
    g = GradHistory(5, recent=64, old=32)
    total = 0
    for k in (1, 7, 63, 64, 65, 200, 3, 1000, 5):
        steps = np.arange(total, total + k)
        g.extend(steps, np.tile(steps[:, None], (1, 5)).astype(np.float32))
        total += k
        steps_kept, rows = g.matrix()
        assert len(g) <= 64 + 32
        assert (np.diff(steps_kept) > 0).all()
        np.testing.assert_array_equal(rows[:, 0], steps_kept)
        # The most recent rows are kept at full resolution.
        tail = steps_kept[-min(total, 64) :]
        np.testing.assert_array_equal(tail, np.arange(total - len(tail), total))
    assert g.stride > 1
    assert g.matrix()[0][0] == 0  # the start of the run survives decimation


def test_grad_history_memory_does_not_grow_with_the_run() -> None:
    state = RunState(dict(RUN))
    state.apply({"type": "layers", "names": layer_names(50), "numel": [1] * 50})
    for start in range(0, 6000, 500):
        state.apply(pack_steps(step_records(start, 500, 50), 50))
    assert state.n_steps == 6000
    assert len(state.grads) <= 1024
    assert state.grads.total_rows == 6000


def test_sampled_grads_only_on_some_steps() -> None:
    state = state_with(steps=100, layers=3, grad_every=4)
    assert state.grads.total_rows == 25
    assert state.grads.latest_step() == 96


def test_alerts_newest_first_and_bounded() -> None:
    state = RunState(dict(RUN))
    for i in range(MAX_ALERTS + 20):
        state.apply(
            {
                "type": "alert",
                "kind": "loss_spike",
                "severity": "warning",
                "step": i,
                "time": 0.0,
                "message": f"spike {i}",
                "layers": ["a", "b"],
            }
        )
    assert len(state.alerts) == MAX_ALERTS
    assert state.alert_count == MAX_ALERTS + 20
    assert state.alerts[0].step == MAX_ALERTS + 19
    assert state.alerts[0].layers == ("a", "b")


def test_steps_per_second_and_elapsed() -> None:
    state = state_with(steps=400)  # one step every 50 ms
    rate = state.steps_per_sec()
    assert rate is not None and abs(rate - 20.0) < 0.01
    state.mark("ended", "shutdown")
    assert state.elapsed() == state.cols["time"].values[-1] - RUN["start_time"]


def test_input_bound_detection() -> None:
    assert not state_with(data_share=0.1).input_bound
    slow = state_with(data_share=0.5)
    assert slow.input_bound
    share = slow.anatomy()["data_time"]
    assert share is not None and abs(share - 0.5) < 1e-9


def test_system_probe_and_protocol_errors_are_kept() -> None:
    state = state_with()
    assert state.system is not None and "CUDA: not in use" in state.system.missing
    assert state.probe is not None and state.probe.cost_fraction == 0.006
    assert state.synced
    before = state.n_steps
    state.apply({"type": "steps", "n": 3, "layers": 0, "lr_groups": 0})
    bad = pack_steps(step_records(500, 2, 4), 4)
    bad["loss"] = bad["loss"][:8]
    state.apply(bad)
    assert state.n_steps == before
    assert len(state.errors) == 2


def test_revision_changes_on_every_visible_update() -> None:
    state = RunState(dict(RUN))
    r0 = state.revision
    state.apply({"type": "pong", "id": 1})
    assert state.revision == r0
    state.apply({"type": "probe", "cost_fraction": 0.01})
    assert state.revision > r0


def test_layer_trends_sign() -> None:
    state = RunState(dict(RUN))
    state.apply({"type": "layers", "names": ["up", "down"], "numel": [1, 1]})
    recs = [
        StepRecord(step=i, time=float(i), loss=1.0, grad_norms=[10.0**i, 10.0**-i])
        for i in range(8)
    ]
    state.apply(pack_steps(recs, 2))
    trend = state.layer_trends()
    assert trend[0] > 0 > trend[1]


def test_many_layers_many_steps_through_the_model() -> None:
    state = RunState(dict(RUN))
    state.apply_many(synthetic_run(steps=300, n_layers=1000, batch=30))
    assert state.n_steps == 300
    latest = state.grads.latest()
    assert latest is not None and latest.shape == (1000,)


def test_formatting_helpers() -> None:
    assert fmt(None) == "n/a"
    assert fmt(float("nan")) == "n/a"
    assert fmt(3, "d") == "3"
    assert fmt_bytes(None) == "n/a"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_loss(float("inf")) == "+inf"


def test_scalar_history_is_bounded_recent_steps_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    import tdbg.model.run_state as model

    monkeypatch.setattr(model, "MAX_SCALAR_ROWS", 1000)
    state = RunState(dict(RUN))
    state.apply({"type": "layers", "names": layer_names(3), "numel": [1] * 3})
    for start in range(0, 20_000, 250):
        state.apply(pack_steps(step_records(start, 250, 3), 3))
    steps = state.steps.values
    assert len(steps) <= 1000 + 250
    assert state.thinned_steps > 0
    assert np.all(np.diff(steps) > 0), "thinning must keep the steps in order"
    assert steps[0] == 0 and steps[-1] == 19_999
    assert list(steps[-400:]) == list(range(19_600, 20_000)), "recent steps stay exact"
    n = len(steps)
    assert len(state.loss.values) == len(state.lr.values) == len(state.loss_ema.values) == n
    assert all(len(c.values) == n for c in state.cols.values())


def test_a_step_shows_only_its_own_learning_rates() -> None:
    """lr_n says how many of a row's lr columns are real: a NaN within them is an unreadable
    lr (shown as missing), columns past them are padding and not a param group at all."""
    state = RunState(dict(RUN))
    records = [
        StepRecord(step=0, time=0.0, loss=1.0, lr=[0.1, 0.2, 0.3]),
        StepRecord(step=1, time=1.0, loss=1.0, lr=[0.1, math.nan]),
    ]
    state.apply(pack_steps(records, 0))
    assert state.latest_lr() == [0.1, None]  # two groups now; the second unreadable
    state.apply(pack_steps([StepRecord(step=2, time=2.0, loss=1.0, lr=[])], 0))
    assert state.latest_lr() == []
