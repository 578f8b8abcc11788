"""RunState and MetricStore decode issue 10's numbers: micro-batches, clipping, epoch, total
steps, what is watched, user metrics (NaN kept), and older batches without them."""

from __future__ import annotations

import math

from tdbg.model.metrics import MAX_NAMES, MAX_POINTS, MetricStore, loss_like
from tdbg.model.run_state import RunState
from tdbg.protocol.messages import metrics_message
from tdbg.protocol.steps import OPTIONAL_COLUMNS, StepRecord, pack_steps
from tdbg.tui.sources.synthetic import RUN, synthetic_run


def state_of(**kwargs: object) -> RunState:
    state = RunState(dict(RUN))
    state.apply_many(synthetic_run(**kwargs))  # type: ignore[arg-type]
    return state


def test_new_step_columns_decode() -> None:
    state = state_of(steps=250, n_layers=6)
    assert state.micro_batches == 4
    assert state.epoch == 2
    clip = state.clipping()
    assert clip is not None and clip.max_norm == 1.0 and clip.steps == 250
    norms = state.cols["clip_norm"].values
    assert clip.active == int((norms > 1.0).sum()) and 0 < clip.active_share < 1
    assert clip.last_norm == norms[-1]
    # The norms shown are the pre-clip ones: their total is what the clip measured.
    assert math.isclose(float(state.grad_total.values[-1]), clip.last_norm, rel_tol=1e-2)


def test_an_older_batch_without_the_columns_reads_unknown() -> None:
    records = [StepRecord(step=s, time=float(s), loss=1.0, lr=[0.1]) for s in range(3)]
    msg = pack_steps(records, 0)
    for name in OPTIONAL_COLUMNS:
        del msg[name]  # as an older probe or recording wrote it
    state = RunState({})
    state.apply(msg)
    assert state.n_steps == 3 and not state.errors
    assert state.micro_batches is None and state.epoch is None and state.clipping() is None


def test_a_step_without_clip_does_not_count() -> None:
    records = [
        StepRecord(step=0, time=0.0, loss=1.0, clip_max=1.0, clip_norm=2.0),
        StepRecord(step=1, time=1.0, loss=1.0),  # no clip_grad_norm_ this step
        StepRecord(step=2, time=2.0, loss=1.0, clip_max=1.0, clip_norm=0.5),
    ]
    state = RunState({})
    state.apply(pack_steps(records, 0))
    clip = state.clipping()
    assert clip is not None and (clip.steps, clip.active, clip.last_norm) == (2, 1, 0.5)


def test_progress_eta_and_probe_states() -> None:
    state = state_of(steps=400, total_steps=1000, skipped_steps=3)
    state.connection = "live"
    assert state.planned_steps == 1000 and state.progress() == 0.4
    eta = state.eta()
    assert eta is not None and math.isclose(eta, 600 / 20.0, rel_tol=0.05)  # 20 steps/s
    assert state.skipped_steps == 3 and not state.probe_closed and not state.probe_disabled
    closed = state_of(steps=10, closed=True)
    assert closed.probe_closed and closed.eta() is None
    unknown = state_of(steps=10, total_steps=None)
    assert unknown.planned_steps is None and unknown.progress() is None and unknown.eta() is None


def test_what_is_watched() -> None:
    state = state_of(steps=5, n_layers=8)
    assert state.models == ["netG", "netD"]
    assert state.optimizers == [("optG", "Adam", 1), ("optD", "Adam", 1)]
    assert state.lr_labels(2) == ["optG", "optD"]
    assert [state.layer_owner(i) for i in (0, 3, 4, 7)] == ["netG", "netG", "netD", "netD"]
    many = RunState(
        {"optimizers": [{"name": "opt", "type": "AdamW", "groups": 3}], "param_groups": 100}
    )
    assert many.lr_labels(4) == ["opt.0", "opt.1", "opt.2", "group 3"]
    assert many.param_groups == 100 and many.lr_columns_capped
    single = state_of(steps=5, models=("model",))
    assert single.layer_owner(0) is None  # one model: nothing to group


def test_metrics_keep_nan_and_finite_min_max() -> None:
    state = RunState({})
    state.apply(dict(metrics_message([(0, "val_loss", 2.0), (5, "val_loss", 1.0)])))
    state.apply(dict(metrics_message([(10, "val_loss", math.nan), (10, "acc", 0.5)])))
    series = state.metrics["val_loss"]
    assert series.last is not None and math.isnan(series.last) and series.last_step == 10
    assert (series.lo, series.hi, series.nonfinite, series.count) == (1.0, 2.0, 1, 3)
    assert state.metrics.names == ["val_loss", "acc"]
    assert [s.name for s in state.metrics.loss_like()] == ["val_loss"]
    assert [s.name for s in state.metrics.others()] == ["acc"]
    # A malformed point is dropped by the protocol's reader, the rest kept.
    state.apply({"type": "metrics", "points": [[1, "acc"], ["x", "acc", 1.0], [11, "acc", 0.7]]})
    assert state.metrics["acc"].n == 2


def test_metrics_are_bounded() -> None:
    store = MetricStore()
    store.add((s, "m", float(s)) for s in range(3 * MAX_POINTS))
    series = store["m"]
    assert series.n <= MAX_POINTS and series.count == 3 * MAX_POINTS
    assert series.last == 3 * MAX_POINTS - 1 and series.lo == 0.0  # min/max over all points
    store.add((0, f"name{i}", 1.0) for i in range(MAX_NAMES + 10))
    assert len(store) == MAX_NAMES and store.dropped_names == 11


def test_metrics_until_a_replay_cursor() -> None:
    store = MetricStore()
    store.add([(0, "a", 3.0), (10, "a", 1.0), (20, "a", 2.0), (15, "b", 5.0)])
    head = store.until(12)
    assert head.names == ["a"] and head["a"].last == 1.0 and head["a"].hi == 3.0


def test_loss_like_names() -> None:
    for name in ("val_loss", "eval_loss", "loss/netG", "train/loss", "loss", "Loss_D"):
        assert loss_like(name), name
    for name in ("acc", "val/acc", "lossless_ratio", "grad_scale", "closs_rate"):
        assert not loss_like(name), name


def test_watching_says_what_is_watched_plainly() -> None:
    from tdbg.tui.widgets.run_header import watching

    assert watching(state_of(steps=2)) == (
        "watching netG, netD · optimizers optG (Adam), optD (Adam) · 2 param groups"
    )
    one = RunState(
        {
            "models": ["model"],
            "optimizers": [{"name": "optimizer", "type": "AdamW", "groups": 1}],
            "param_groups": 1,
        }
    )
    assert watching(one) == "watching model · optimizer (AdamW)"
    named = RunState({"optimizers": [{"name": "sgd_main", "type": "SGD", "groups": 2}]})
    assert watching(named) == "optimizer sgd_main (SGD) · 2 param groups"
    assert watching(RunState({})) == ""  # an older probe says nothing
