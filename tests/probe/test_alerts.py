"""Alert rules: each condition alerts at onset, names its layers, and keeps quiet on noise."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from tdbg.probe import alerts
from tdbg.probe.alerts import AlertRules, robust_z
from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.stall import DEFAULT_STALL_RULE
from tdbg.protocol.steps import StepRecord

LAYERS = ["embed", "block.0", "block.1", "head"]


def rec(step: int, loss: float | None = 1.0, **kw: object) -> StepRecord:
    return StepRecord(step=step, time=float(step), loss=loss, **kw)  # type: ignore[arg-type]


def grads(step: int, norms: list[float], loss: float | None = 1.0, **kw: object) -> StepRecord:
    total = math.sqrt(sum(v * v for v in norms))
    return rec(step, loss, grad_total=total, grad_norms=norms, **kw)


def kinds(out: Sequence[Alert]) -> list[str]:
    return [a.kind for a in out]


def run(rules: AlertRules, records: list[StepRecord], missing: Sequence[int] = ()) -> list[Alert]:
    out: list[Alert] = []
    for r in records:
        out.extend(rules.check_step(r, missing))
    return out


def test_nan_loss_alerts_at_onset_only() -> None:
    rules = AlertRules(LAYERS)
    assert run(rules, [rec(i, 1.0) for i in range(5)]) == []
    out = run(rules, [rec(5, math.nan), rec(6, math.nan), rec(7, math.inf)])
    assert kinds(out) == ["nonfinite_loss"]
    assert out[0].step == 5 and out[0].severity == "error"
    assert "nan" in out[0].message
    # recovery then a new onset alerts again
    assert run(rules, [rec(8, 1.0)]) == []
    again = run(rules, [rec(9, -math.inf)])
    assert kinds(again) == ["nonfinite_loss"] and again[0].step == 9


def test_nan_grads_name_the_layers() -> None:
    rules = AlertRules(LAYERS)
    out = run(rules, [grads(0, [1.0, math.nan, math.inf, 1.0])])
    assert kinds(out) == ["nonfinite_grad"]
    assert list(out[0].layers) == ["block.0", "block.1"]
    assert "block.0" in out[0].message and "block.1" in out[0].message
    # persisting: quiet; a different set of layers: a new alert
    assert run(rules, [grads(1, [1.0, math.nan, math.inf, 1.0])]) == []
    out = run(rules, [grads(2, [math.nan, 1.0, 1.0, 1.0])])
    assert kinds(out) == ["nonfinite_grad"] and list(out[0].layers) == ["embed"]


def test_no_grad_names_the_layers() -> None:
    rules = AlertRules(LAYERS)
    out = run(rules, [grads(0, [1.0, 1.0, 0.0, 0.0])], missing=[2, 3])
    assert kinds(out) == ["no_grad"]  # missing layers are not also reported as zero
    assert list(out[0].layers) == ["block.1", "head"]
    assert run(rules, [grads(1, [1.0, 1.0, 0.0, 0.0])], missing=[2, 3]) == []
    # cleared, then again
    assert run(rules, [grads(2, [1.0, 1.0, 1.0, 1.0])]) == []
    assert kinds(run(rules, [grads(3, [1.0, 1.0, 1.0, 0.0])], missing=[3])) == ["no_grad"]


def test_zero_grad_names_the_layers() -> None:
    rules = AlertRules(LAYERS)
    out = run(rules, [grads(0, [0.0, 1.0, 1.0, 0.0])])
    assert kinds(out) == ["zero_grad"]
    assert list(out[0].layers) == ["embed", "head"]
    assert run(rules, [grads(1, [0.0, 1.0, 1.0, 0.0])]) == []


def test_many_layers_are_abbreviated_in_the_message() -> None:
    names = [f"l{i}" for i in range(12)]
    out = AlertRules(names).check_step(grads(0, [math.nan] * 12))
    assert list(out[0].layers) == names
    assert "and 4 more" in out[0].message


def noisy(n: int, center: float, spread: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [center * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_exploding_gradient_by_robust_z() -> None:
    rules = AlertRules(LAYERS)
    base = noisy(60, 1.0, 0.3, seed=1)
    assert run(rules, [grads(i, [v, v, v, v]) for i, v in enumerate(base)]) == []
    out = run(rules, [grads(60, [1.0, 1.0, 40.0, 1.0])])
    assert kinds(out) == ["exploding_grad"]
    assert list(out[0].layers)[0] == "block.1"  # the largest layer is named first


def test_loss_spike_by_robust_z() -> None:
    rules = AlertRules(LAYERS)
    assert run(rules, [rec(i, v) for i, v in enumerate(noisy(50, 2.0, 0.2, seed=2))]) == []
    out = run(rules, [rec(50, 50.0)])
    assert kinds(out) == ["loss_spike"]
    assert out[0].step == 50


def test_no_spike_verdict_before_enough_history() -> None:
    rules = AlertRules(LAYERS)
    out = run(rules, [rec(i, 1.0) for i in range(alerts.MIN_HISTORY - 1)] + [rec(99, 1000.0)])
    assert out == []


@pytest.mark.parametrize("seed", range(5))
def test_no_false_alarm_on_a_noisy_but_stable_series(seed: int) -> None:
    rng = random.Random(seed)
    rules = AlertRules(LAYERS)
    out = []
    for i in range(2000):
        loss = 3.0 * math.exp(-i / 800) * (1 + rng.gauss(0, 0.1))  # a decaying, noisy loss
        g = abs(rng.lognormvariate(0, 0.4))  # heavy-ish tailed gradient norms
        out.extend(rules.check_step(grads(i, [g, g * 0.5, g * 2, g], loss=loss)))
    assert out == []


def test_constant_series_then_small_wiggle_is_not_a_spike() -> None:
    rules = AlertRules(LAYERS)
    run(rules, [rec(i, 1.0) for i in range(40)])
    # z is huge (MAD is 0) but the value is not SPIKE_RATIO times the median
    assert run(rules, [rec(40, 1.5)]) == []
    assert kinds(run(rules, [rec(41, 10.0)])) == ["loss_spike"]


def test_robust_z() -> None:
    assert robust_z(1.0, [1.0, 1.0, 1.0]) == 0.0
    assert robust_z(5.0, [1.0, 2.0, 3.0]) == pytest.approx(3 / 1.4826)


def test_lr_zero_after_three_steps() -> None:
    rules = AlertRules(LAYERS)
    assert run(rules, [rec(0, lr=[0.0, 0.1]), rec(1, lr=[0.0, 0.1])]) == []
    out = run(rules, [rec(2, lr=[0.0, 0.1])])
    assert kinds(out) == ["lr_zero"] and out[0].step == 2
    assert "0" in out[0].message
    assert run(rules, [rec(3, lr=[0.0, 0.1]), rec(4, lr=[0.0, 0.1])]) == []
    # recovery and a relapse alert again
    assert run(rules, [rec(5, lr=[0.1, 0.1])]) == []
    assert kinds(run(rules, [rec(i, lr=[0.0, 0.0]) for i in range(6, 9)])) == ["lr_zero"]


def test_lr_zero_names_the_layers_its_groups_update() -> None:
    # Per layer, its param group's lr column: embed and head in group 0, the blocks in group 1
    # (its learning rate 0), the frozen embedding in group 0 too.
    rules = AlertRules(LAYERS, frozen=[0], lr_groups=[0, 1, 1, 0])
    out = run(rules, [rec(i, lr=[0.1, 0.0]) for i in range(3)])
    assert kinds(out) == ["lr_zero"]
    assert out[0].layers == ("block.0", "block.1")
    assert out[0].message == (
        "learning rate is 0 in param group(s) 1: layers block.0, block.1 learn nothing"
    )
    one = AlertRules(LAYERS, lr_groups=[0, 0, 0, 1])
    (only,) = run(one, [rec(i, lr=[0.1, 0.0]) for i in range(3)])
    assert only.layers == ("head",) and only.message.endswith("layer head learns nothing")
    every = AlertRules(LAYERS, lr_groups=[0, 0, 0, 1])
    (both,) = run(every, [rec(i, lr=[0.0, 0.0]) for i in range(3)])
    assert both.message.endswith("nothing is learning") and len(both.layers) == 4
    # A layout that does not say which layers a group updates: the groups alone.
    (unknown,) = run(AlertRules(LAYERS), [rec(i, lr=[0.1, 0.0]) for i in range(3)])
    assert unknown.layers == () and unknown.message.endswith("the layers in them learn nothing")


def test_warm_up_starting_at_zero_is_not_an_alert() -> None:
    rules = AlertRules(LAYERS)
    lrs = [0.0, 1e-4, 2e-4, 3e-4, 4e-4] + [5e-4] * 10
    assert run(rules, [rec(i, lr=[v]) for i, v in enumerate(lrs)]) == []


def test_lr_zero_for_two_steps_is_not_an_alert() -> None:
    rules = AlertRules(LAYERS)
    lrs = [0.0, 0.0, 0.1, 0.0, 0.0, 0.1]
    assert run(rules, [rec(i, lr=[v]) for i, v in enumerate(lrs)]) == []


def test_stall_then_resumed() -> None:
    rules = AlertRules(LAYERS)
    run(rules, [rec(i, step_time=0.1) for i in range(10)])
    assert rules.check_resumed(10) == []  # nothing stalled yet
    assert rules.check_stall(9, 1.0) == []  # slow, but under the 5 s floor
    out = rules.check_stall(9, 6.0)
    assert kinds(out) == ["stalled"] and out[0].step == 9
    assert rules.check_stall(9, 7.0) == []  # onset only
    resumed = rules.check_resumed(10)
    assert kinds(resumed) == ["resumed"] and resumed[0].step == 10
    assert rules.check_resumed(11) == []


def test_stall_threshold_scales_with_the_usual_step_time() -> None:
    rules = AlertRules(LAYERS)
    run(rules, [rec(i, step_time=2.0) for i in range(10)])
    assert rules.check_stall(9, 35.0) == []  # 20x the median step is 40 s
    assert kinds(rules.check_stall(9, 41.0)) == ["stalled"]


def test_the_probe_stalls_by_the_rule_it_announces() -> None:
    """A run stepping once a second is stalled after the rule's fast cap (9 s), not 20 s: the
    probe's alert and every reader of its hello call the same gap a stall."""
    rules = AlertRules(LAYERS)
    run(rules, [rec(i, step_time=1.0) for i in range(10)])
    limit = DEFAULT_STALL_RULE.limit(1.0)
    assert limit == 9.0
    assert rules.check_stall(9, limit - 0.5) == []
    assert kinds(rules.check_stall(9, limit + 0.5)) == ["stalled"]


def test_no_stall_verdict_without_step_times() -> None:
    rules = AlertRules(LAYERS)
    run(rules, [rec(0), rec(1)])
    assert rules.check_stall(1, 1000.0) == []


def test_layers_frozen_at_a_relayout_raise_no_zero_gradient_alert() -> None:
    # A backbone frozen with its head replaced: the passes rebuilt then read none of its
    # parameters, so its norm is 0 and expected; the others still alert.
    rules = AlertRules(LAYERS)
    rules.relayout(LAYERS, {}, frozen=[0, 1])
    assert run(rules, [grads(5, [0.0, 0.0, 1.0, 1.0])]) == []
    out = run(rules, [grads(6, [0.0, 0.0, 0.0, 1.0])])
    assert kinds(out) == ["zero_grad"] and list(out[0].layers) == ["block.1"]
