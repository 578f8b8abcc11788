"""The probe's history for late clients: within its byte budget after every add, newest steps
whole, old stretches thinned evenly (per-layer rows first), steps in order."""

from __future__ import annotations

import pytest

from tdbg.probe.serving.history import History
from tdbg.protocol.steps import StepRecord, batch_bytes, grad_rows, pack_steps, unpack_steps


def batches(n_layers: int, steps: int, size: int = 30, every: int = 1):
    for start in range(0, steps, size):
        yield pack_steps(
            [
                StepRecord(
                    step=s,
                    time=float(s),
                    loss=float(s),
                    lr=[0.1, 0.01],
                    grad_total=1.0 if s % every == 0 else None,
                    grad_norms=[float(s)] * n_layers if s % every == 0 else None,
                )
                for s in range(start, min(start + size, steps))
            ],
            n_layers,
        )


def replayed(history: History) -> list[StepRecord]:
    return [r for m in history.replay() if m["type"] == "steps" for r in unpack_steps(m)]


@pytest.mark.parametrize(
    ("n_layers", "budget", "steps"),
    [(0, 1 << 20, 40_000), (50, 1 << 20, 20_000), (3, 4 << 20, 60_000)],
)
def test_the_budget_holds_after_every_add_and_the_newest_steps_stay(
    n_layers: int, budget: int, steps: int
) -> None:
    history = History(n_layers, budget=budget)
    for msg in batches(n_layers, steps):
        history.add(msg)
        assert history.bytes <= budget
        assert history.bytes == sum(
            batch_bytes(m) for m in history.replay() if m["type"] == "steps"
        )
    records = replayed(history)
    numbers = [r.step for r in records]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert numbers[-300:] == list(range(steps - 300, steps))  # the newest stretch is whole
    assert numbers[0] < steps // 4  # the start of the run is still there, thinned
    assert all(r.loss == r.step and r.lr == [0.1, 0.01] for r in records)  # rows intact


def test_per_layer_rows_go_before_any_step_and_evenly() -> None:
    history = History(20, budget=768 << 10)  # room for every step, not every row
    for msg in batches(20, 4_000):
        history.add(msg)
    records = replayed(history)
    assert [r.step for r in records] == list(range(4_000))  # every step's scalars kept
    with_rows = [r.step for r in records if r.grad_norms is not None]
    assert 0 < len(with_rows) < 4_000 and with_rows[-1] == 3_999
    old = [b - a for a, b in zip(with_rows, with_rows[1:], strict=False) if b < 2_000]
    assert old and max(old) <= 4 * min(old)  # spaced evenly, not one stretch emptied
    assert all(r.grad_norms == [float(r.step)] * 20 for r in records if r.grad_norms)


def test_a_pass_touches_one_or_two_chunks() -> None:
    """Amortised cost: over budget, one add never reworks the whole history."""
    history = History(3, budget=2 << 20)
    for msg in batches(3, 40_000):
        history.add(msg)
    before = [id(m) for m in history.chunks]
    history.add(next(batches(3, 30)))
    after = {id(m) for m in history.chunks}
    assert len([i for i in before if i not in after]) <= 4
    assert sum(grad_rows(m) for m in history.chunks) >= 0
