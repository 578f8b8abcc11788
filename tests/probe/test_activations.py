"""Activation statistics match a slow reference per leaf; hooks exist only on sampled steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import OpenReader, dive_context, wait_until
from torch import nn

import tdbg
from tdbg.probe.dives.activations import ActivationsDive, floating_tensors
from tdbg.probe.dives.base import DiveContext

NAN = float("nan")
FIELDS = {
    "type",
    "step",
    "names",
    "types",
    "mean",
    "std",
    "min",
    "max",
    "zero_frac",
    "nonfinite",
    "hist",
    "hist_stride",
}


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def samples(ctx: DiveContext) -> list[dict[str, Any]]:
    return [e for e in ctx.events if e["type"] == "activations"]


def reference(outputs: list[torch.Tensor]) -> dict[str, float]:
    """The slow way: every call's output flattened together, statistics in float64."""
    x = torch.cat([o.detach().double().flatten() for o in outputs])
    return {
        "mean": x.mean().item(),
        "std": x.std().item() if x.numel() > 1 else NAN,
        "min": x.min().item(),
        "max": x.max().item(),
        "zero_frac": (x == 0).double().mean().item(),
        "nonfinite": int((~torch.isfinite(x)).sum().item()),
    }


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6)


class Spiky(nn.Module):
    """A leaf that writes one inf and one NaN into its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[0, 0] = math.inf
        y[1, 1] = NAN
        return y


class Model(nn.Module):
    """Dead ReLU units, a shared Tanh called twice, a half-precision output, a spiky leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        with torch.no_grad():
            self.inp.bias[:12] = -100.0  # 12 of 32 units never fire: a dead-ReLU fraction
        self.relu = nn.ReLU()
        self.body = nn.Sequential(nn.Linear(32, 16), nn.Tanh())
        self.act = nn.Tanh()  # shared: two calls per step
        self.spiky = Spiky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.inp(x))
        h = self.act(self.body(h))
        h = self.act(h * 2)
        return self.spiky(h.half()).float()


def leaf_outputs(model: Model, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each leaf's outputs for input ``x``, computed by hand (the test's slow path)."""
    with torch.no_grad():
        inp = model.inp(x)
        relu = model.relu(inp)
        lin = model.body[0](relu)
        tanh = model.body[1](lin)
        act1 = model.act(tanh)
        act2 = model.act(act1 * 2)
        spiky = model.spiky(act2.half())
    return {
        "inp": [inp],
        "relu": [relu],
        "body.0": [lin],
        "body.1": [tanh],
        "act": [act1, act2],
        "spiky": [spiky],
    }


def run(
    model: nn.Module,
    args: dict[str, Any],
    steps: int,
    step_fn: Callable[[int], None],
    on_boundary: Callable[[int, ActivationsDive], None] | None = None,
) -> tuple[DiveContext, ActivationsDive]:
    ctx = dive_context(model)
    dive = ActivationsDive(ctx, 3, args, "manual")
    dive.start(0)
    for step in range(1, steps + 1):
        step_fn(step)
        dive.boundary(step)
        if on_boundary is not None:
            on_boundary(step, dive)
    return ctx, dive


def test_statistics_equal_a_slow_reference_per_leaf() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(64, 8)
    ctx, dive = run(model, {"every": 10, "enabled": True}, 1, lambda _: model(x))
    [message] = samples(ctx)
    assert set(message) == FIELDS
    assert message["step"] == 1
    expected = leaf_outputs(model, x)
    assert message["names"] == list(expected)  # named_modules() order, leaves only
    assert message["types"] == ["Linear", "ReLU", "Linear", "Tanh", "Tanh", "Spiky"]
    for i, name in enumerate(message["names"]):
        ref = reference(expected[name])
        for key in ("mean", "std", "min", "max", "zero_frac"):
            assert same(message[key][i], ref[key]), (name, key, message[key][i], ref[key])
        assert message["nonfinite"][i] == ref["nonfinite"], name
    by_name = dict(zip(message["names"], range(len(message["names"])), strict=True))
    assert message["zero_frac"][by_name["relu"]] >= 12 / 32  # the dead units at least
    assert message["nonfinite"][by_name["spiky"]] == 2
    assert math.isnan(message["mean"][by_name["spiky"]])  # NaN is data here, not a crash
    assert all(isinstance(v, int) for v in message["nonfinite"])
    dive.cancelled(2, "off")
    assert hook_count(model) == 0


def test_hooks_exist_only_on_sampled_steps() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.register_forward_pre_hook(lambda *a: None)  # the user's: left alone
    baseline = hook_count(model)
    armed_during: dict[int, bool] = {}

    def step(index: int) -> None:
        armed_during[index] = hook_count(model) > baseline
        model(torch.randn(5, 4)).sum().backward()

    ctx, dive = run(model, {"every": 3, "enabled": True}, 8, step)
    assert [s for s, armed in sorted(armed_during.items()) if armed] == [1, 4, 7]
    assert [m["step"] for m in samples(ctx)] == [1, 4, 7]
    assert samples(ctx)[0]["names"] == ["0", "1", "2"]
    assert hook_count(model) == baseline  # after 8: nothing armed until step 10
    assert dive.stepping and not dive.finished
    states = [e["state"] for e in ctx.events if e["type"] == "job"]
    assert states == []  # no job event per step (the runner sends "running" after start)
    dive.cancelled(9, "replaced")
    dive.release()
    assert hook_count(model) == baseline
    assert ctx.events[-1]["state"] == "cancelled"


def test_every_step_keeps_one_set_of_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    counts: list[int] = []
    ctx, dive = run(
        model,
        {"every": 1, "enabled": True},
        4,
        lambda _: model(torch.randn(3, 4)),
        lambda _, d: counts.append(hook_count(model)),
    )
    assert counts == [2, 2, 2, 2]  # one forward hook per leaf, never doubled
    assert [m["step"] for m in samples(ctx)] == [1, 2, 3, 4]
    dive.cancelled(5, "off")
    assert hook_count(model) == 0


def test_enabled_false_ends_at_once_without_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    ctx = dive_context(model)
    dive = ActivationsDive(ctx, 4, {"every": 10, "enabled": False}, "manual")
    dive.start(0)
    assert hook_count(model) == 0
    assert not dive.stepping and dive.finished
    [event] = list(ctx.events)
    assert (event["state"], event["message"]) == ("cancelled", "activation statistics off")
    assert event["total"] is None


def test_odd_outputs_are_skipped_and_nothing_reaches_the_loop() -> None:
    class Odd(nn.Module):
        def __init__(self, value: Any) -> None:
            super().__init__()
            self.value = value

        def forward(self, x: torch.Tensor) -> Any:
            return self.value(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.none = Odd(lambda x: None)
            self.int = Odd(lambda x: 3)
            self.ints = Odd(lambda x: torch.arange(4))
            self.empty = Odd(lambda x: torch.empty(0, 4))
            self.one = Odd(lambda x: x[:1, :1] * 1.0)
            self.nested = Odd(lambda x: (torch.arange(2), [None, {"k": (x * 3, "text")}]))
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for leaf in (self.none, self.int, self.ints, self.empty, self.one, self.nested):
                leaf(x)
            return self.lin(x)

    model = Model()
    x = torch.randn(3, 4)
    errors: list[BaseException] = []
    ctx = dive_context(model, errors)
    dive = ActivationsDive(ctx, 5, {"every": 1, "enabled": True}, "manual")
    dive.start(0)
    model(x).sum().backward()
    dive.boundary(1)
    assert errors == []
    [message] = samples(ctx)
    assert message["names"] == ["one", "nested", "lin"]
    one, nested = 0, 1
    assert message["mean"][one] == pytest.approx(x[0, 0].item())
    assert math.isnan(message["std"][one])  # std of one element, as torch gives it
    assert message["mean"][nested] == pytest.approx((x * 3).mean().item(), rel=1e-5)
    dive.cancelled(2, "off")
    assert hook_count(model) == 0


def test_a_failing_hook_fails_the_job_not_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    errors: list[BaseException] = []
    ctx = dive_context(model, errors)
    dive = ActivationsDive(ctx, 6, {"every": 1, "enabled": True}, "manual")
    dive.start(0)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "var_mean", broken)
    model(torch.randn(3, 4)).sum().backward()  # nothing raised here
    monkeypatch.undo()
    assert errors and str(errors[0]) == "boom"
    with pytest.raises(RuntimeError, match="boom"):
        dive.boundary(1)  # the runner's guard turns this into failed + release
    dive.release()
    assert hook_count(model) == 0


def test_floating_tensors_walks_nested_outputs_once() -> None:
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.float16)
    found = list(floating_tensors((a, [None, 1, {"b": b, "a": a}], torch.arange(3), "s")))
    assert [t is a for t in found] == [True, False] and found[1] is b


# --- through the real probe ---------------------------------------------------------------


def test_activations_from_watch_reach_a_client(runtime_dir: Path, probe_reader: OpenReader) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    probe = tdbg.watch(model, opt, name="unit", activations_every=2)
    reader = probe_reader(probe)
    try:
        reader.wait(lambda r: r.of("synced"))
        baseline = hook_count(model)  # the probe's own phase hooks
        armed = []
        for _ in range(8):
            armed.append(hook_count(model) > baseline)
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            probe.step(loss)
        wait_until(lambda: len(reader.of("activations")) >= 3, what="three samples")
        message = reader.of("activations")[-1]
        assert set(message) == FIELDS
        assert message["names"] == ["0", "1", "2"]
        assert message["types"] == ["Linear", "ReLU", "Linear"]
        assert 0.0 <= message["zero_frac"][1] <= 1.0 and message["nonfinite"] == [0, 0, 0]
        steps = [m["step"] for m in reader.of("activations")]
        assert all(b - a == 2 for a, b in zip(steps, steps[1:], strict=False))
        assert 3 <= sum(armed) <= 5  # about every other step, never all of them
        jobs = [m for m in reader.of("job") if m["command"] == "activations"]
        assert jobs and jobs[-1]["state"] == "running" and jobs[-1]["total"] is None
    finally:
        reader.close()
        probe.close()
    assert hook_count(model) == 0


def test_a_sampled_step_with_no_module_output_fails_the_job_not_with_empty_numbers() -> None:
    """Hooks armed and never called (a compiled forward, or none at all): the job fails with
    why, the hooks go, and no ``activations`` message claims a sample."""

    class Net(nn.Module):  # a forward of the user's own: dynamo traces it, hooks and all
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.relu = nn.Linear(4, 4), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.relu(self.lin(x))

    torch._dynamo.reset()
    model = Net()
    model.compile(backend="eager", fullgraph=True)  # in place; traced with the hooks armed
    ctx, dive = run(model, {"every": 2, "enabled": True}, 1, lambda _: model(torch.randn(3, 4)))
    assert samples(ctx) == []
    assert not dive.stepping and dive.finished and hook_count(model) == 0
    [event] = [e for e in ctx.events if e["type"] == "job"]
    assert event["state"] == "failed" and event["step"] == 1
    assert event["message"].startswith(
        "no module output seen at step 1: the model runs compiled (torch.compile)"
    )
