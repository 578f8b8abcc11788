"""The step batch's layout has one owner: protocol's COLUMNS describe the whole message, and the
TUI's numpy reading (live and at a replay cursor) agrees with protocol's own unpack."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tdbg.model.columns import StepBatch
from tdbg.model.run_state import RunState
from tdbg.model.timeline import Timeline
from tdbg.probe.serving.recorder import Recorder
from tdbg.protocol.framing import pack
from tdbg.protocol.steps import (
    COLUMNS,
    ITEMSIZE,
    StepRecord,
    batch_bytes,
    concat_steps,
    joinable,
    pack_steps,
    row_bytes,
    unpack_steps,
)
from tdbg.recording.reader import Recording
from tdbg.tui.sources.synthetic import RUN, layer_names

HEADER = {"type", "n", "layers", "lr_groups", "history"}
NAN = math.nan
# Learning rates per step: param groups come and go, and a NaN is an lr the probe could not read
# (a real group), unlike the NaN padding of a row shorter than the batch's widest.
LRS = [[0.1, 0.2, 0.3], [0.1, NAN], [], [0.5], [NAN, NAN, 0.25], [0.4, 0.3]]


def records(n_layers: int = 3, start: int = 0) -> list[StepRecord]:
    out = []
    for i, lr in enumerate(LRS):
        step = start + i
        grads = [float(step + k) for k in range(n_layers)] if i % 2 == 0 else None
        out.append(
            StepRecord(
                step=step,
                time=100.0 + step,
                loss=None if i == 3 else 1.0 / (step + 1),
                lr=list(lr),
                step_time=0.5 + i,
                samples=float(8 * i),
                data_time=0.01 * i,
                grad_total=None if grads is None else float(sum(grads)),
                grad_norms=grads,
            )
        )
    return out


def as_lr(values: list[float]) -> list[float | None]:
    """A step's learning rates as the TUI shows them: an unreadable one as None."""
    return [None if math.isnan(v) else v for v in values]


def test_columns_describe_the_whole_message() -> None:
    msg = pack_steps(records(), 3)
    assert set(msg) - HEADER == {name for name, _ in COLUMNS}
    for name, _ in COLUMNS:
        assert len(msg[name]) % ITEMSIZE[name] == 0, name
    joined = concat_steps([msg, pack_steps(records(start=len(LRS)), 3)])
    assert joined is not None and set(joined) == set(msg)
    assert [r.step for r in unpack_steps(joined)] == list(range(2 * len(LRS)))


def test_sizes_and_joining_follow_the_columns() -> None:
    for n_layers, groups in ((0, 0), (3, 1), (1000, 4)):
        rows = [
            StepRecord(step=i, time=0.0, lr=[0.1] * groups, grad_norms=[1.0] * n_layers)
            for i in range(7)
        ]
        msg = pack_steps(rows, n_layers)
        assert batch_bytes(msg) == 7 * row_bytes(n_layers, groups)
        assert joinable(msg, pack_steps(rows[:2], n_layers))
        scalars = [StepRecord(step=0, time=0.0, lr=[0.1] * groups)]
        assert not joinable(msg, pack_steps(scalars, n_layers + 1))  # rows of another width
        wider = [StepRecord(step=0, time=0.0, lr=[0.1] * (groups + 1))]
        assert not joinable(msg, pack_steps(wider, n_layers))
        assert concat_steps([msg, pack_steps(wider, n_layers)]) is None


def test_the_numpy_batch_agrees_with_unpack() -> None:
    msg = pack_steps(records(), 3)
    batch = StepBatch.decode(msg)
    recs = unpack_steps(msg)
    assert (batch.n, batch.n_layers, batch.lr_groups) == (len(recs), 3, 3)
    assert batch.steps.tolist() == [r.step for r in recs]
    assert batch.has_loss.tolist() == [r.loss is not None for r in recs]
    np.testing.assert_array_equal(batch.loss, [NAN if r.loss is None else r.loss for r in recs])
    for i, r in enumerate(recs):
        assert as_lr(batch.lr[i, : batch.lr_n[i]].tolist()) == as_lr(r.lr)
    for name, column in batch.timings.items():
        np.testing.assert_array_equal(column, [getattr(r, name) for r in recs], err_msg=name)
    with_grads = [r for r in recs if r.grad_norms is not None]
    assert batch.grad_steps.tolist() == [r.step for r in with_grads]
    assert batch.grad_total.tolist() == [r.grad_total for r in with_grads]
    assert batch.grad_rows.tolist() == [list(r.grad_norms or ()) for r in with_grads]


def test_each_step_shows_its_own_learning_rates_live_and_in_replay(tmp_path: Path) -> None:
    """lr_n says how many of a row's lr columns are real: the TUI shows a step's own groups, an
    unreadable one as missing, and never the padding of a shorter row, at every replay cursor
    as on the live screen."""
    recs = records()
    live = RunState(dict(RUN))
    for i, rec in enumerate(recs):
        live.apply(pack_steps([rec], 3))
        assert live.latest_lr() == as_lr(LRS[i]), f"live, step {i}"

    path = tmp_path / "lr.tdbgrec"
    recorder = Recorder(path, RUN, layer_names(3), [1, 1, 1])
    assert recorder.open()
    msg = pack_steps(recs, 3)  # one batch: every row padded to three groups
    recorder.add_steps(msg, pack(msg))
    recorder.close()
    timeline = Timeline(Recording(path))
    assert len(timeline) == len(LRS)
    for i, lr in enumerate(LRS):
        assert timeline.state_at(i).latest_lr() == as_lr(lr), f"replay cursor at step {i}"


def test_batches_without_the_newer_columns_read_them_as_nan():
    """A recording written before micro_batches/clip/epoch existed still decodes and joins."""
    import math

    from tdbg.protocol.steps import OPTIONAL_COLUMNS, StepRecord, concat_steps, pack_steps

    new = pack_steps([StepRecord(step=1, time=1.0, micro_batches=4, clip_max=1.0)], 0)
    old = {k: v for k, v in pack_steps([StepRecord(step=0, time=0.0)], 0).items()}
    for name in OPTIONAL_COLUMNS:
        old.pop(name)
    joined = concat_steps([old, new])
    assert joined is not None
    records = unpack_steps(joined)
    assert [r.step for r in records] == [0, 1]
    assert math.isnan(records[0].micro_batches) and records[1].micro_batches == 4
    assert records[1].clip_max == 1.0 and math.isnan(records[1].clip_norm)


def test_metrics_reader_drops_malformed_points_and_keeps_nan():
    import math

    from tdbg.protocol.messages import metrics_message, read_metrics

    msg = metrics_message([(3, "val_loss", 0.5), (4, "acc", float("nan"))])
    msg["points"] += [["x", "a", 1.0], [5, 7, 1.0], [6, "b", "str"], [7, "c"]]  # type: ignore
    points = read_metrics(msg)
    assert points[0] == (3, "val_loss", 0.5)
    assert points[1][:2] == (4, "acc") and math.isnan(points[1][2])
    assert len(points) == 2
    assert read_metrics({"points": None}) == [] and read_metrics(None) == []


def test_layers_that_grow_mid_run_keep_the_gradient_history() -> None:
    """A layer replaced or a model added mid-run: the layers list grows, earlier rows read NaN."""
    from tdbg.protocol.steps import StepRecord, pack_steps

    state = RunState()
    state.apply({"type": "layers", "names": ["a", "b"], "numel": [1, 1]})
    state.apply(pack_steps([StepRecord(step=0, time=0.0, grad_total=1.0, grad_norms=[1, 2])], 2))
    state.apply({"type": "layers", "names": ["a", "b", "c"], "numel": [1, 1, 4], "gone": [1]})
    # A batch packed before the probe thread saw the change: two norms, padded.
    state.apply(pack_steps([StepRecord(step=1, time=1.0, grad_total=1.0, grad_norms=[3, 4])], 2))
    state.apply(pack_steps([StepRecord(step=2, time=2.0, grad_total=1.0, grad_norms=[5, 6, 7])], 3))
    assert state.layer_names == ["a", "b", "c"]
    assert state.grads.n_layers == 3 and len(state.grads) == 3
    # And the probe side packs an old, shorter row into a wider batch with NaN.
    msg = pack_steps([StepRecord(step=3, time=3.0, grad_total=1.0, grad_norms=[1.0])], 3)
    assert math.isnan(unpack_steps(msg)[0].grad_norms[2])  # type: ignore[index]
