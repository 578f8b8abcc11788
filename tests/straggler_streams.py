"""Synthetic job step streams for the slowest-rank-over-time tests: ranks whose batches wait
as a pattern says (noise, a rank always slow, one that comes and goes), fed in batches."""

from __future__ import annotations

import random
from collections.abc import Callable

from tdbg.model.job import Job
from tdbg.model.run_state import RunState
from tdbg.model.straggler_history import StragglerHistory
from tdbg.protocol.steps import StepRecord, pack_steps

# rank, step -> seconds that rank waits for its batch at that step
Pattern = Callable[[int, int], float]


def job_of(ranks: int) -> Job:
    return Job(
        "j1",
        {
            r: RunState({"name": "t", "rank": r, "world_size": ranks, "job": "j1"})
            for r in range(ranks)
        },
    )


def record(step: int, data: float, compute: float = 0.010) -> StepRecord:
    """A step whose own work is ``data + compute``; backward holds the all-reduce wait."""
    return StepRecord(
        step=step,
        time=float(step),
        loss=1.0,
        step_time=data + compute + 0.005,
        data_time=data,
        forward_time=compute,
        backward_time=0.005,
        optimizer_time=0.0,
    )


def run(
    job: Job, history: StragglerHistory | None, steps: range, data: Pattern, batch: int = 5
) -> None:
    """The ranks' steps in batches, the history fed after each, as the job screen feeds it."""
    for first in range(steps.start, steps.stop, batch):
        apply_steps(job, range(first, min(first + batch, steps.stop)), data)
        if history is not None:
            history.update(job)


def apply_steps(job: Job, steps: range, data: Pattern) -> None:
    """Steps ``steps`` of every rank still running, with the phases ``data`` gives."""
    for rank, state in job.ranks.items():
        if not state.ended:
            state.apply(pack_steps([record(s, data(rank, s)) for s in steps], 0))


def noise(seed: int) -> Pattern:
    rng = random.Random(seed)
    return lambda rank, step: rng.uniform(0.001, 0.004)


def intermittent(rank: int, period: int, length: int) -> Pattern:
    """``rank`` waits 30 ms a batch for ``length`` steps of every ``period``; the rest is noise."""
    base = noise(2)
    return lambda r, s: base(r, s) + (0.030 if r == rank and s % period >= period - length else 0.0)
