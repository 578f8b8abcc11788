"""The probe thread's short way for a usual CPU step gives the record the whole way gives."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tdbg.probe.training import budget
from tdbg.probe.training.hooks import StepTimeline
from tdbg.probe.training.pending import usual_record, usual_step

NAN = float("nan")


def timeline(**marks: float | None) -> StepTimeline:
    tl = StepTimeline()
    for name, value in marks.items():
        setattr(tl, name, value)
    return tl


FULL = {"forward_start": 10.0, "forward_end": 10.5, "optimizer_start": 11.25, "optimizer_end": 11.5}
TIMELINES = {
    "every phase": timeline(**FULL),
    "an evaluation before the forward": timeline(**FULL, no_grad_start=9.0, no_grad_end=9.5),
    "an evaluation whose end was not seen": timeline(**FULL, no_grad_start=9.0),
    "an evaluation longer than the gap": timeline(**FULL, no_grad_start=1.0, no_grad_end=9.9),
    "no forward seen": timeline(optimizer_start=11.25, optimizer_end=11.5),
    "no forward, an evaluation without end": timeline(
        no_grad_start=9.0, optimizer_start=11.25, optimizer_end=11.5
    ),
    "no optimizer end": timeline(forward_start=10.0, forward_end=10.5, optimizer_start=11.25),
}
LOSSES: dict[str, Any] = {
    "a float": 0.75,
    "a CPU scalar tensor": torch.tensor(0.5),
    "a NaN": NAN,
    "an Inf tensor": torch.tensor(float("inf"), dtype=torch.float64),
}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)
    return bool(a == b)


@pytest.mark.parametrize("marks", list(TIMELINES), ids=list(TIMELINES))
@pytest.mark.parametrize("loss", list(LOSSES), ids=list(LOSSES))
@pytest.mark.parametrize(
    "counts",
    [(None, None, 0, None, None), (8, 4096.0, 3, 9.0, 1_000.0 - 0.0125)],
    ids=["bare", "counted"],
)
def test_a_usual_step_resolves_to_the_same_record_either_way(
    marks: str, loss: str, counts: tuple[Any, Any, int, Any, Any]
) -> None:
    samples, tokens, micro, previous_end, last_start = counts
    raw = (
        41,  # step
        1_000.0,  # probe.step()'s start (perf clock)
        LOSSES[loss],
        micro,
        samples,
        tokens,
        [0.1, 0.01],
        last_start,  # the step before's start (None: the first step)
        TIMELINES[marks],
        previous_end,
        2.0,  # epoch
        1_000.0 + 4e-6,  # probe.step()'s end
        5e-6,  # the hooks' and taps' seconds
        1e-6,  # of which timed whole
    )
    resolved = usual_step(raw).resolve()
    assert resolved is not None
    whole, missing = resolved
    short = usual_record(raw)
    assert tuple(missing) == ()
    for field in whole.__slots__:
        if field == "time":  # each reads the wall clock
            assert short.time == pytest.approx(whole.time, abs=0.5)
            continue
        assert same(getattr(short, field), getattr(whole, field)), field
    # Worked out on the probe thread from the readings handed over: start to start, and what
    # the step timed of itself counted as the cost model counts it.
    assert same(short.step_time, NAN if last_start is None else 0.0125)
    assert short.probe_time == pytest.approx(budget.probe_seconds(4e-6 + 5e-6, 1e-6))
    assert short.probe_time == pytest.approx(
        1e-6 + 8e-6 * (1 + budget.FIXED_UNTIMED) + budget.FIXED_PER_STEP
    )


@pytest.mark.parametrize("loss", list(LOSSES), ids=list(LOSSES))
def test_a_lean_step_s_readings_are_the_usual_step_they_stand_for(loss: str) -> None:
    # A lean step (lean.py) is handed over as its readings: the probe thread makes the usual
    # step of one micro-batch, no work timed whole and no no-grad phase, its fixed work
    # counted at the lean scale; either way of resolving it gives the same record.
    lean = (
        41,  # step
        1_000.0,  # probe.step()'s start
        LOSSES[loss],
        8,  # samples
        None,  # tokens
        [0.1],
        1_000.0 - 0.0125,  # the step before's start
        *FULL.values(),  # forward start, backward start, optimizer start and end
        9.0,  # the previous step's end
        2.0,  # epoch
        1_000.0 + 4e-6,  # probe.step()'s end
        5e-6,  # the hooks' and taps' seconds
    )
    resolved = usual_step(lean).resolve()
    assert resolved is not None
    whole, _ = resolved
    short = usual_record(lean)
    for field in whole.__slots__:
        if field != "time":
            assert same(getattr(short, field), getattr(whole, field)), field
    assert short.micro_batches == 1.0 and short.samples == 8.0 and math.isnan(short.tokens)
    assert short.forward_time == pytest.approx(0.5) and short.optimizer_time == pytest.approx(0.25)
    assert short.data_time == pytest.approx(1.0) and short.no_grad_time == 0.0
    assert short.probe_time == pytest.approx(9e-6 * budget.LEAN_SCALE + budget.FIXED_PER_STEP)
