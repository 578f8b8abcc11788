"""The first non-finite alert names where it began — a weight, a forward, a backward — and the step,
on real small models trained on the CPU, measured the way the probe measures them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tdbg.probe.serving.nan_origin import KIND, NanOrigin, Origin
from tdbg.probe.training.gradients import find_layers
from tdbg.probe.training.guard import NonfiniteGuard, find_forward_origin
from tdbg.protocol.messages.alert import Alert

K = 4  # the step where it goes wrong
STEPS = 7


class InfGrad(torch.autograd.Function):
    """Identity forward; backward returns inf where armed."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if InfGrad.armed else grad


class Spike(nn.Module):
    """A scale with a weight, then InfGrad: its own weight gradient goes inf when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InfGrad.apply(x * self.scale)


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e30 * 1e30 if self.armed else x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.Tanh()
        self.spike = Spike()
        self.boom = Boom()
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.boom(self.spike(self.act(self.fc1(x)))))))


def train(scenario: str, guard: bool = False) -> tuple[NanOrigin, list[Alert], Net]:
    """STEPS steps of SGD; at step K the scenario goes wrong. Per step, at the point of the
    optimizer pre-hook: the weights' finiteness per layer, the gradient norms per layer, and (when
    the guard finds non-finite gradients) the forward re-run — then NanOrigin.observe."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    layers = find_layers(model)
    names = [layer.name for layer in layers]
    params = [p for layer in layers for p in layer.params]
    layer_of = [i for i, layer in enumerate(layers) for _ in layer.params]
    nonfinite_guard = NonfiniteGuard(params, layer_of)
    origin = NanOrigin(names)
    alerts: list[Alert] = []
    try:
        for step in range(1, STEPS + 1):
            model.boom.armed = scenario == "forward" and step == K
            InfGrad.armed = scenario == "backward" and step == K
            if scenario == "weights" and step == K:
                with torch.no_grad():
                    model.fc2.weight[1, 2] = float("nan")
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            # the optimizer pre-hook
            weight_bad = [
                i
                for i, layer in enumerate(layers)
                if not all(bool(torch.isfinite(p).all()) for p in layer.params)
            ]
            norms = [
                math.sqrt(
                    sum(float(p.grad.norm()) ** 2 for p in layer.params if p.grad is not None)
                )
                for layer in layers
            ]
            forward = None
            if guard and nonfinite_guard.check_and_skip():
                forward = find_forward_origin(model, (x,))
            opt.step()
            event = origin.observe(step, float(loss.detach()), norms, weight_bad, forward)
            if event is not None:
                alerts.append(event)
    finally:
        InfGrad.armed = False
    return origin, alerts, model


def check(origin: NanOrigin, alerts: list[Alert], phase: str, module: str) -> Origin:
    assert len(alerts) == 1, alerts  # the first event only
    found = origin.origin
    assert found is not None
    assert (found.step, found.phase, found.module) == (K, phase, module)
    assert found.last_finite == K - 1
    event = alerts[0]
    assert event.kind == KIND and event.severity == "error" and event.step == K
    assert module in event.message and f"step {K}" in event.message
    assert event.layers == (module,)
    return found


def test_a_weight_turned_nan() -> None:
    origin, alerts, _ = train("weights")
    found = check(origin, alerts, "weights", "fc2")
    assert f"weights of fc2 non-finite at step {K} (finite at step {K - 1})" in found.detail


def test_a_forward_overflow_from_finite_weights() -> None:
    origin, alerts, model = train("forward", guard=True)
    found = check(origin, alerts, "forward", "boom")
    assert found.module_type == "Boom" and (found.nonfinite or 0) > 0
    # the guard kept the model intact: no weight ever went non-finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_forward_overflow_without_the_guard_says_loss_and_how_to_name_it() -> None:
    origin, alerts, _ = train("forward")
    assert len(alerts) == 1
    found = origin.origin
    assert found is not None and (found.step, found.phase, found.module) == (K, "loss", None)
    assert "skip_nonfinite=True" in alerts[0].message


def test_a_backward_made_inf_with_a_finite_loss() -> None:
    origin, alerts, _ = train("backward")
    found = check(origin, alerts, "backward", "spike")  # fc1 too, but spike is nearest the loss
    assert "backward" in found.detail


def test_a_backward_inf_skipped_by_the_guard() -> None:
    origin, alerts, model = train("backward", guard=True)
    check(origin, alerts, "backward", "spike")
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_finite_run_no_alert() -> None:
    origin, alerts, _ = train("none")
    assert alerts == [] and origin.origin is None and origin.last_finite == STEPS


def test_unmeasured_steps_count_as_finite_by_what_was_seen() -> None:
    origin = NanOrigin(["a", "b"])
    assert origin.observe(1, 1.0, None, None) is None
    assert origin.observe(2, None, [1.0, 2.0], []) is None
    event = origin.observe(3, 1.0, [math.inf, math.nan], None)
    assert event is not None and event.layers == ("b",)
    assert origin.observe(4, math.nan, None, [0, 1]) is None  # only the first event
    assert origin.origin is not None and origin.origin.as_dict()["last_finite"] == 2


def test_skipped_alert_names_layers_and_count() -> None:
    from tdbg.probe.serving.nan_origin import SKIPPED_KIND, skipped_alert

    event = skipped_alert(5, ["fc1", "fc2"], [1], 2)
    assert event.kind == SKIPPED_KIND and event.severity == "warning"
    assert event.layers == ("fc2",) and "step 5" in event.message
    assert "2 update(s) skipped" in event.message


def test_an_unmeasured_loss_never_claims_finite_weights() -> None:
    origin = NanOrigin(["a", "b"])
    assert origin.observe(1, 1.0, [1.0, 1.0], []) is None
    event = origin.observe(2, math.nan, None, None)  # not a sampled step: nothing measured
    assert event is not None and event.step == 2 and event.layers == ()
    assert "finite weights" not in event.message and "not measured" in event.message
    grads_only = NanOrigin(["a", "b"])  # a sampled step whose gradients came out finite
    event = grads_only.observe(2, math.nan, [1.0, 1.0], None)
    assert event is not None and "finite weights" not in event.message
    assert "gradients were finite; the weights were not read" in event.message
    measured = NanOrigin(["a", "b"])
    event = measured.observe(2, math.nan, [math.nan, math.nan], [])  # weights measured finite
    assert event is not None and "with finite weights" in event.message


def test_an_unmeasured_update_that_left_weights_nonfinite_is_named_at_its_step() -> None:
    """Step 3's loss is finite, its gradients not measured; step 4's pass finds the weights of
    a and b non-finite and nothing but the optimizer changed them: the update of step 3."""
    origin = NanOrigin(["a", "b", "c"])
    assert origin.observe(2, 1.0, [1.0, 1.0, 1.0], []) is None
    assert origin.observe(3, 0.9, None, None) is None
    event = origin.observe(4, math.nan, [math.nan] * 3, [0, 1], changed=[])
    assert event is not None and event.step == 3 and event.layers == ("b",)
    found = origin.origin
    assert found is not None and (found.phase, found.step, found.last_finite) == ("backward", 3, 2)
    assert "not measured" in event.message


def test_a_weight_other_code_changed_is_the_origin_at_the_step_that_used_it() -> None:
    origin = NanOrigin(["a", "b", "c"])
    origin.observe(2, 1.0, [1.0, 1.0, 1.0], [])
    origin.observe(3, 0.9, None, None)
    event = origin.observe(4, math.nan, [math.nan] * 3, [2], changed=[2])
    assert event is not None and event.step == 4 and event.layers == ("c",)
    assert origin.origin is not None and origin.origin.phase == "weights"


def test_a_measured_step_before_keeps_the_weights_at_their_step() -> None:
    origin = NanOrigin(["a", "b"])
    origin.observe(3, 0.9, [1.0, 1.0], [])  # measured, finite: the update of step 3 made it
    event = origin.observe(4, math.nan, [math.nan] * 2, [1])
    assert event is not None and event.step == 4
    assert origin.origin is not None and origin.origin.phase == "weights"


def test_the_guard_s_skipped_layers_name_a_backward_on_an_unsampled_step() -> None:
    origin = NanOrigin(["a", "b", "c"])
    origin.observe(1, 1.0, None, None)
    event = origin.observe(2, 1.0, None, None, grad_nonfinite=[0, 1])
    assert event is not None and event.step == 2 and event.layers == ("b",)


def test_changed_layers_tell_other_code_from_the_optimizer() -> None:
    from tdbg.probe.training.gradients import GradientStats

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = GradientStats(find_layers(model))
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    for step in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step in (0, 3):
            stats.note_versions()
        if step == 2:
            with torch.no_grad():
                model.fc2.weight[0, 0] = 1.0
        opt.step()
    names = [layer.name for layer in find_layers(model)]
    assert [names[i] for i in stats.changed_layers() or []] == ["fc2"]
    stats.note_versions()  # nothing but the optimizer since: no layer
    assert stats.changed_layers() == []


def test_the_advice_to_re_run_the_forward_is_given_only_where_the_probe_does_not() -> None:
    """A non-finite loss with finite weights and no module named: on a GPU without the guard
    the alert advises watch(skip_nonfinite=True), which re-runs the forward; where the probe
    re-runs it already (the CPU, or the guard on) it says the re-run found no module, and
    points at the loss computation, never at an option that is already on."""
    gpu = NanOrigin(["a", "b"])
    event = gpu.observe(2, math.nan, [math.nan, math.nan], [])
    assert event is not None and "watch(skip_nonfinite=True) re-runs" in event.message
    cpu = NanOrigin(["a", "b"])
    cpu.reruns_forward = True
    event = cpu.observe(2, math.nan, [math.nan, math.nan], [])
    assert event is not None and "skip_nonfinite" not in event.message
    assert "found no module's output non-finite: look at the loss computation" in event.message
    for probe_reruns in (False, True):  # finite gradients: nothing re-run, nor to advise
        grads_only = NanOrigin(["a", "b"])
        grads_only.reruns_forward = probe_reruns
        event = grads_only.observe(2, math.nan, [1.0, 1.0], None)
        assert event is not None and "skip_nonfinite" not in event.message
        assert "re-run" not in event.message
        assert "the NaN reached the loss, not the gradients" in event.message
