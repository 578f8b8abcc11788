"""The overhead budget: how often gradients are sampled, as a rule and on a real probe."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Loop, Reader

import tdbg
from tdbg.probe.budget import MAX_AUTO_INTERVAL, gradient_interval

MS = 1e-3


@pytest.mark.parametrize(
    ("step", "grad", "fixed", "budget", "expected"),
    [
        (10 * MS, 1 * MS, 0.0, 0.01, 10),  # 1 ms of norms in a 0.1 ms budget: every 10th step
        (10 * MS, 0.1 * MS, 0.0, 0.01, 1),  # it fits: every step
        (10 * MS, 0.11 * MS, 0.0, 0.01, 2),  # just over: every other step
        (10 * MS, 1 * MS, 0.05 * MS, 0.01, 20),  # the fixed cost leaves half the budget
        (10 * MS, 1 * MS, 1 * MS, 0.01, 40),  # fixed cost over budget: norms get a quarter
        (100 * MS, 1 * MS, 0.0, 0.01, 1),  # a longer step has room for it
        (10 * MS, 1 * MS, 0.0, 0.10, 1),  # a larger budget has room for it
        (1 * MS, 1000 * MS, 0.0, 0.01, MAX_AUTO_INTERVAL),  # bounded: some gradients always show
        (0.0, 1 * MS, 0.0, 0.01, 1),  # nothing measured yet: every step
        (10 * MS, 0.0, 0.0, 0.01, 1),
        (float("nan"), 1 * MS, 0.0, 0.01, 1),
    ],
)
def test_gradient_interval(
    step: float, grad: float, fixed: float, budget: float, expected: int
) -> None:
    assert gradient_interval(step, grad, fixed, budget) == expected


def test_gradient_interval_grows_with_cost_and_shrinks_with_budget() -> None:
    costs = [gradient_interval(10 * MS, g * MS, 0.0, 0.01) for g in (0.05, 0.2, 1, 5, 50)]
    assert costs == sorted(costs) and costs[0] == 1 and costs[-1] > costs[1]
    budgets = [gradient_interval(10 * MS, 1 * MS, 0.0, b) for b in (0.001, 0.01, 0.1)]
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] == 1


def sampled_steps(budget: float, steps: int, runtime_dir: Path) -> tuple[int, list[int]]:
    """Run a real loop under ``budget``; (the probe's interval, the steps that had norms)."""
    loop = Loop()
    probe = tdbg.watch(loop.model, loop.opt, overhead_budget=budget)
    assert probe.socket_path
    reader = Reader(probe.socket_path)
    loop.run(steps, probe)
    reader.wait(lambda r: len(r.records()) == steps)
    interval = probe.grad_interval
    probe.close()
    reader.close()
    return interval, [r.step for r in reader.records() if r.grad_norms is not None]


def test_a_tiny_budget_samples_rarely_and_a_generous_one_every_step(runtime_dir: Path) -> None:
    # Orders of magnitude either side of any real cost, so no machine's speed decides it.
    interval, sampled = sampled_steps(1e-9, 300, runtime_dir)
    assert interval == MAX_AUTO_INTERVAL
    assert 1 <= len(sampled) <= 10  # the first steps, before any cost was measured
    interval, sampled = sampled_steps(1e9, 100, runtime_dir)
    assert interval == 1 and sampled == list(range(100))
