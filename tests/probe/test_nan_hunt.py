"""The NaN hunt names the module where a value first went non-finite, and leaves no hook behind."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import OpenReader, dive_context, linear_at, wait_until
from torch import nn

import tdbg
from tdbg.probe.dives.base import DiveContext
from tdbg.probe.dives.nan_hunt import NanHuntDive

NAN = float("nan")
BATCH = 6


# --- helpers ------------------------------------------------------------------------------


def hook_census(model: nn.Module) -> list[int]:
    """Every hook torch could run for this model: module hooks of all four kinds and every
    parameter's post-accumulate-grad hooks, one count per place."""
    counts: list[int] = []
    for module in model.modules():
        for hooks in (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        ):
            counts.append(len(hooks))
    for param in model.parameters():
        counts.append(len(getattr(param, "_post_accumulate_grad_hooks", None) or {}))
    return counts


def hunt(
    model: nn.Module,
    step_fn: Callable[[int], None],
    steps: int = 1,
    max_steps: int = 20,
    trigger: str = "manual",
) -> tuple[DiveContext, dict[str, Any]]:
    """Run a hunt the way the runner does: start at the boundary after step 0, then train a step
    and call the boundary, until the dive wants no more steps. Returns (ctx, the done result);
    asserts that no hook of the hunt is left and the model's own hooks are untouched."""
    before = hook_census(model)
    ctx = dive_context(model)
    dive = NanHuntDive(ctx, 7, {"steps": steps}, trigger)
    dive.start(0)
    assert sum(hook_census(model)) > sum(before)  # armed
    step = 0
    while dive.stepping:
        step += 1
        assert step <= max_steps, "the hunt never ended"
        step_fn(step)
        dive.boundary(step)
    assert hook_census(model) == before, "a hook was left behind"
    dive.release()  # idempotent
    assert hook_census(model) == before
    finals = [e for e in ctx.events if e["state"] in ("done", "failed", "cancelled")]
    assert [e["state"] for e in finals] == ["done"], list(ctx.events)
    return ctx, finals[0]["result"]


SPEC_FIELDS = {
    "found",
    "phase",
    "module",
    "module_type",
    "step",
    "nonfinite",
    "numel",
    "input_min",
    "input_max",
    "input_nonfinite",
    "params_nonfinite",
    "steps_checked",
    "trigger",
}


class Poison(nn.Module):
    """Adds NaN to three columns of its input on the steps in ``on``; otherwise the identity."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.on: set[int] = set()
        self.step = 0
        self.width = width
        self.inputs: dict[int, torch.Tensor] = {}  # by step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs[self.step] = x.detach().clone()
        if self.step in self.on:
            bad = torch.zeros(self.width)
            bad[:3] = NAN
            return x + bad
        return x * 1.0


class NanGradFn(torch.autograd.Function):
    """The identity forward; backward makes the first ``k`` columns of the gradient NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        grad[:, : ctx.k] = NAN
        return grad, None


class BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanGradFn.apply(x, 5)


class NanWeightGradFn(torch.autograd.Function):
    """y = x @ w.T with a correct input gradient and a NaN weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, torch.full_like(w, NAN)


class BadWeightGrad(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NanWeightGradFn.apply(x, self.weight)


def trainer(model: nn.Module, x: torch.Tensor, lr: float = 0.01) -> Callable[[int], None]:
    """One real SGD step per call; ``step`` is passed to every Poison in the model."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(index: int) -> None:
        for module in model.modules():
            if isinstance(module, Poison):
                module.step = index
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()

    return step


# --- forward ------------------------------------------------------------------------------


def test_forward_nan_is_named_exactly_with_an_inplace_relu_after_it() -> None:
    torch.manual_seed(0)
    poison = Poison(16)
    poison.on = {2}
    model = nn.Sequential(nn.Linear(8, 16), poison, nn.ReLU(inplace=True), nn.Linear(16, 4))
    model.register_forward_hook(lambda *a: None)  # the user's own hook must survive the hunt
    x = torch.randn(BATCH, 8)
    ctx, result = hunt(model, trainer(model, x), steps=3)
    assert set(result) == SPEC_FIELDS
    assert result["found"] is True
    assert result["phase"] == "forward"
    assert result["module"] == "1" and result["module_type"] == "Poison"
    assert result["step"] == 2 and result["steps_checked"] == 2
    assert result["nonfinite"] == BATCH * 3 and result["numel"] == BATCH * 16
    assert result["input_nonfinite"] is False and result["params_nonfinite"] == 0
    assert result["input_min"] == pytest.approx(poison.inputs[2].min().item())
    assert result["input_max"] == pytest.approx(poison.inputs[2].max().item())
    assert result["trigger"] == "manual"
    states = [e["state"] for e in ctx.events]
    assert states == ["running", "running", "done"]  # 1/3 clean, 2/3 armed, then found in 2


def test_nan_weights_are_named_with_their_count() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(BATCH, 8)
    with torch.no_grad():
        linear_at(model, 2).weight[0, 0] = NAN
        linear_at(model, 2).weight[1, 3] = math.inf
    _, result = hunt(model, trainer(model, x, lr=0.0), trigger="auto")
    assert (result["found"], result["phase"], result["module"]) == (True, "forward", "2")
    assert result["params_nonfinite"] == 2
    assert result["input_nonfinite"] is False
    assert result["nonfinite"] == BATCH * 2  # rows 0 and 1 of every output
    assert result["trigger"] == "auto"


def test_nan_data_is_reported_as_already_nonfinite_inputs() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(BATCH, 8)
    x[0, 0] = NAN
    _, result = hunt(model, trainer(model, x))
    assert (result["phase"], result["module"], result["module_type"]) == ("forward", "0", "Linear")
    assert result["input_nonfinite"] is True
    assert math.isnan(result["input_min"]) and math.isnan(result["input_max"])
    assert result["nonfinite"] == 4  # one row of the output


def test_a_nan_made_by_the_root_itself_names_the_root() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.inner(x) - 100.0)  # log of negatives: NaN, not in a child

    model = Root()
    _, result = hunt(model, trainer(model, torch.randn(BATCH, 4)))
    assert (result["phase"], result["module"], result["module_type"]) == ("forward", "", "Root")


def test_a_nan_made_between_children_names_the_enclosing_module() -> None:
    """An attention-like block whose own code (not a child) makes the NaN before its output
    Linear: the Linear is the first with a NaN output, but it got NaN; the block made it."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)
            self.o = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.q(x).masked_fill(torch.ones(4, dtype=torch.bool), -math.inf)
            return self.o(scores.softmax(-1))  # a fully masked row: NaN

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.ReLU())
    _, result = hunt(model, trainer(model, torch.randn(BATCH, 4)))
    assert (result["phase"], result["module"], result["module_type"]) == ("forward", "1", "Block")
    assert result["input_nonfinite"] is False
    assert (result["nonfinite"], result["numel"]) == (BATCH * 4, BATCH * 4)


def test_weight_sharing_records_every_call() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = Poison(4)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.shared.on = set()
            h = self.lin(self.shared(x))
            self.shared.on = {self.shared.step}  # the second call of the same module poisons
            return self.shared(h)

    model = Twice()
    _, result = hunt(model, trainer(model, torch.randn(BATCH, 4)))
    assert (result["phase"], result["module"]) == ("forward", "shared")
    assert result["nonfinite"] == BATCH * 3


def test_eval_steps_without_backward_still_find_a_forward_nan() -> None:
    poison = Poison(4)
    poison.on = {1}
    model = nn.Sequential(nn.Linear(4, 4), poison)

    def evaluate(step: int) -> None:
        poison.step = step
        with torch.no_grad():
            model(torch.randn(BATCH, 4))

    _, result = hunt(model, evaluate)
    assert (result["found"], result["phase"], result["module"]) == (True, "forward", "1")


# --- backward -----------------------------------------------------------------------------


def test_backward_nan_from_a_custom_function_is_named() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), BadBackward(), nn.ReLU(inplace=True), nn.Linear(16, 4))
    x = torch.randn(BATCH, 8)
    h = model[0](x).detach()  # its input, before the NaN gradients reach the weights
    _, result = hunt(model, trainer(model, x), steps=2)
    assert set(result) == SPEC_FIELDS
    assert (result["found"], result["phase"]) == (True, "backward")
    assert (result["module"], result["module_type"]) == ("1", "BadBackward")
    assert result["step"] == 1 and result["steps_checked"] == 1
    assert result["nonfinite"] == BATCH * 5 and result["numel"] == BATCH * 16
    assert result["input_nonfinite"] is False  # the gradient arrived at its output finite
    assert result["input_min"] == pytest.approx(h.min().item())
    assert result["input_max"] == pytest.approx(h.max().item())


def test_backward_inf_from_sqrt_of_zero_is_named() -> None:
    class SqrtGate(nn.Module):
        """sqrt(x * gate) with zeros in the gate: finite forward, inf * 0 = NaN backward."""

        def __init__(self, width: int) -> None:
            super().__init__()
            gate = torch.ones(width)
            gate[:2] = 0.0
            self.gate: torch.Tensor
            self.register_buffer("gate", gate)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x * self.gate)

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), SqrtGate(16), nn.Linear(16, 1))
    x = torch.randn(BATCH, 8)
    _, result = hunt(model, trainer(model, x))
    assert (result["phase"], result["module"], result["module_type"]) == (
        "backward",
        "2",
        "SqrtGate",
    )
    assert result["nonfinite"] == BATCH * 2  # the two gated columns of its input gradient


def test_backward_nan_only_in_a_weight_gradient_is_named() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(BadWeightGrad(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(BATCH, 8)  # no grad on the data: only the weight gradient can show it
    _, result = hunt(model, trainer(model, x, lr=0.0))
    assert (result["phase"], result["module"], result["module_type"]) == (
        "backward",
        "0",
        "BadWeightGrad",
    )
    assert result["nonfinite"] == 16 * 8 and result["params_nonfinite"] == 16 * 8
    assert result["input_nonfinite"] is False


def test_a_nan_from_the_loss_is_named_as_arriving_already_nonfinite() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(BATCH, 4)

    def step(_: int) -> None:
        model.zero_grad()
        out = model(x)
        (torch.sqrt(out - out.detach()) * 0).sum().backward()  # NaN gradient from the loss

    _, result = hunt(model, step)
    assert (result["found"], result["phase"]) == (True, "backward")
    assert result["module"] in ("", "1")  # the model's output: the root and its last child
    assert result["input_nonfinite"] is True


# --- nothing found, odd outputs, failure and cancel ---------------------------------------


def test_a_clean_run_finds_nothing_after_all_steps() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    ctx, result = hunt(model, trainer(model, torch.randn(BATCH, 8)), steps=3)
    assert set(result) == SPEC_FIELDS
    assert result["found"] is False and result["steps_checked"] == 3
    assert result["phase"] is None and result["module"] is None and result["step"] is None
    assert [e["state"] for e in ctx.events] == ["running", "running", "analysing", "done"]
    assert [e["message"] for e in list(ctx.events)[:2]] == ["1/3", "2/3"]


def test_odd_outputs_never_reach_the_loop() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            h = self.lin(x)
            return (h, [None, 3, torch.arange(3)], {"a": (h * 2, "text")}, torch.empty(0))

    class Nothing(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    class Number(nn.Module):
        def forward(self, x: torch.Tensor) -> int:
            return 3

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.odd, self.nothing, self.number = Odd(), Nothing(), Number()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _, extra, _ = self.odd(x)
            self.nothing(h)
            self.number(h)
            return h + extra["a"][0]

    model = Model()
    _, result = hunt(model, trainer(model, torch.randn(BATCH, 4)), steps=2)
    assert result["found"] is False and result["steps_checked"] == 2


def test_a_nan_inside_a_nested_output_is_found() -> None:
    class Nested(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return {"out": (x, [x.log()])}  # log of negatives: NaN, deep inside

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nested = Nested()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.nested(x)["out"][0]  # the NaN is not even used

    x = -torch.ones(BATCH, 2)
    model = Model()
    _, result = hunt(model, lambda _: model(x))
    assert (result["phase"], result["module"], result["nonfinite"]) == ("forward", "nested", 12)
    assert result["numel"] == 24


def test_a_finding_ends_the_hunt_while_more_steps_are_armed() -> None:
    """With a real worker, a later step may already be armed when the finding arrives: the
    training thread removes the hooks at the next boundary, and only then ends the job (the
    runner stops calling a finished dive, so finishing earlier would leave the hooks)."""
    poison = Poison(4)
    poison.on = {1}
    model = nn.Sequential(nn.Linear(4, 4), poison)
    before = hook_census(model)
    queued: list[Callable[[], None]] = []
    ctx = dive_context(model)
    ctx.submit = queued.append
    dive = NanHuntDive(ctx, 1, {"steps": 5}, "manual")
    dive.start(0)
    for step in (1, 2):
        poison.step = step
        model(torch.randn(BATCH, 4))
        dive.boundary(step)
    assert dive.stepping and hook_census(model) != before  # step 3 is armed
    for fn in queued:
        fn()
    assert not dive.finished and dive.stepping
    dive.boundary(3)
    assert dive.finished and not dive.stepping and hook_census(model) == before
    assert ctx.events[-1]["state"] == "done" and ctx.events[-1]["result"]["step"] == 1


def test_an_earlier_finding_still_queued_wins_over_the_last_step() -> None:
    """The worker runs in order: step 1's check (found) may still be queued when the last
    step's boundary comes; the job must report step 1's finding, not 'nothing found'."""
    poison = Poison(4)
    poison.on = {1}
    model = nn.Sequential(nn.Linear(4, 4), poison)
    before = hook_census(model)
    queued: list[Callable[[], None]] = []
    ctx = dive_context(model)
    ctx.submit = queued.append
    dive = NanHuntDive(ctx, 1, {"steps": 2}, "manual")
    dive.start(0)
    for step in (1, 2):
        poison.step = step
        model(torch.randn(BATCH, 4))
        dive.boundary(step)
    assert not dive.stepping and hook_census(model) == before  # released at the last step
    assert [e["state"] for e in ctx.events] == ["running", "analysing"]
    for fn in queued:
        fn()
    assert [e["state"] for e in ctx.events] == ["running", "analysing", "done"]
    result = ctx.events[-1]["result"]
    assert (result["found"], result["step"], result["steps_checked"]) == (True, 1, 1)


def test_cancel_mid_hunt_removes_every_hook() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = hook_census(model)
    ctx = dive_context(model)
    dive = NanHuntDive(ctx, 1, {"steps": 5}, "manual")
    dive.start(0)
    out = model(torch.randn(BATCH, 4, requires_grad=True))  # tensor hooks on it now
    dive.cancelled(1, "cancelled by a client")
    assert hook_census(model) == before
    assert not out._backward_hooks  # the tensor hook on the output is gone too
    out.sum().backward()  # no hook of the hunt runs
    assert ctx.events[-1]["state"] == "cancelled"
    dive.release()


def test_a_failing_hook_fails_the_job_not_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = hook_census(model)
    errors: list[BaseException] = []
    ctx = dive_context(model, errors)
    dive = NanHuntDive(ctx, 1, {"steps": 2}, "manual")
    dive.start(0)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "aminmax", broken)
    model(torch.randn(BATCH, 4)).sum().backward()  # nothing raised here
    monkeypatch.undo()
    assert errors and str(errors[0]) == "boom"
    with pytest.raises(RuntimeError, match="boom"):
        dive.boundary(1)  # the runner's guard turns this into failed + release
    dive.release()
    assert hook_census(model) == before


# --- why tensor hooks ---------------------------------------------------------------------


def test_full_backward_hooks_break_inplace_relu() -> None:
    """The reason nan_hunt.py uses tensor hooks: full backward hooks wrap outputs in a custom
    Function's views, which an in-place op after the module may not modify."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    handles = [m.register_full_backward_hook(lambda *a: None) for m in model.modules()]
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        assert "inplace" in str(exc)
    else:
        pytest.skip(f"torch {torch.__version__} allows it now; nan_hunt.py's comment is dated")
    finally:
        for handle in handles:
            handle.remove()
    # The hunt's own hooks on the same model: the step runs.
    _, result = hunt(model, trainer(model, torch.randn(2, 4)))
    assert result["found"] is False


# --- through the real probe ---------------------------------------------------------------


def test_nan_hunt_through_the_probe_and_its_socket(
    runtime_dir: Path, probe_reader: OpenReader
) -> None:
    torch.manual_seed(6)
    poison = Poison(8)
    model = nn.Sequential(nn.Linear(4, 8), poison, nn.ReLU(inplace=True), nn.Linear(8, 1))
    step = trainer(model, torch.randn(BATCH, 4))
    probe = tdbg.watch(model, None, name="unit", nan_hunt=False)
    reader = probe_reader(probe)

    def jobs() -> list[dict[str, Any]]:
        return [m for m in reader.of("job") if m["command"] == "nan_hunt"]

    try:
        reader.wait(lambda r: r.of("synced"))
        for index in range(2):
            step(index)
            probe.step(0.0)
        before = hook_census(model)  # the probe's own phase hooks included
        mid = reader.client.send("nan_hunt", steps=5)
        wait_until(lambda: any(m["id"] == mid for m in reader.of("ack")), what="the ack")
        # The hunt starts at the boundary after the next step (first = its index) and sees
        # the steps after it: poison the second of those.
        first = probe.steps
        poison.on = {first + 2}
        for _ in range(10):
            step(probe.steps)
            probe.step(0.0)
            if any(e["state"] == "done" for e in jobs()):
                break
        reader.wait(lambda r: any(e["state"] == "done" for e in jobs()))
        step(probe.steps)
        probe.step(0.0)  # the boundary that sees the hunt finished (if it was still armed)
        result = [e for e in jobs() if e["state"] == "done"][-1]["result"]
        assert result["found"] is True and result["phase"] == "forward"
        assert (result["module"], result["module_type"]) == ("1", "Poison")
        assert result["step"] == first + 2
        assert result["steps_checked"] == 2 and result["trigger"] == "manual"
        assert hook_census(model) == before
    finally:
        reader.close()
        probe.close()


# --- a known origin heads the answer ------------------------------------------------------


def test_a_known_origin_heads_the_answer_not_the_nan_everywhere_model() -> None:
    """After one update spread NaN into every weight the hunt alone would name the first module;
    the origin the probe found (weights of "2" at step 3) is the answer's headline."""
    from tdbg.probe.origin import Origin

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(NAN)
    x = torch.randn(BATCH, 8)
    _, plain = hunt(model, trainer(model, x, lr=0.0), trigger="auto")
    assert (plain["module"], plain["phase"]) == ("0", "forward")  # the old answer

    before = hook_census(model)
    ctx = dive_context(model)
    ctx.nan_origin = Origin(3, "weights", "2", "weights of 2 non-finite at step 3", 2)
    dive = NanHuntDive(ctx, 8, {"steps": 1}, "auto")
    dive.start(5)
    trainer(model, x, lr=0.0)(6)
    dive.boundary(6)
    wait_until(lambda: any(e["state"] == "done" for e in ctx.events))
    result = next(e["result"] for e in ctx.events if e["state"] == "done")
    assert hook_census(model) == before
    assert set(result) == SPEC_FIELDS
    assert (result["found"], result["phase"], result["module"], result["step"]) == (
        True,
        "weights",
        "2",
        3,
    )
    assert result["module_type"] == "Linear"


def test_an_origin_passed_to_the_dive_names_a_forward_module() -> None:
    from tdbg.probe.origin import Origin

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    with torch.no_grad():
        linear_at(model, 0).weight.fill_(NAN)
    ctx = dive_context(model)
    origin = Origin(
        9, "forward", "1", "forward of 1 (ReLU) made 4 non-finite value(s)", 8, "ReLU", 4
    )
    dive = NanHuntDive(ctx, 9, {"steps": 1}, "auto", origin=origin)
    dive.start(10)
    trainer(model, torch.randn(BATCH, 8), lr=0.0)(11)
    dive.boundary(11)
    wait_until(lambda: any(e["state"] == "done" for e in ctx.events))
    result = next(e["result"] for e in ctx.events if e["state"] == "done")
    assert (result["phase"], result["module"], result["module_type"], result["step"]) == (
        "forward",
        "1",
        "ReLU",
        9,
    )
    assert result["nonfinite"] == 4


def test_a_loss_only_origin_keeps_a_finding_made_with_finite_weights() -> None:
    """Known: the loss went NaN at step 3, no module. The hunt (weights intact, the guard skipped
    the update) finds the module itself: its answer stands."""
    from tdbg.probe.origin import Origin

    model = nn.Sequential(nn.Linear(8, 8), Poison(8), nn.Linear(8, 4))
    poison = model[1]
    assert isinstance(poison, Poison)
    poison.on = {1}
    poison.step = 1
    ctx = dive_context(model)
    ctx.nan_origin = Origin(3, "loss", None, "loss is nan at step 3")
    dive = NanHuntDive(ctx, 10, {"steps": 1}, "auto")
    dive.start(0)
    trainer(model, torch.randn(BATCH, 8), lr=0.0)(1)
    dive.boundary(1)
    wait_until(lambda: any(e["state"] == "done" for e in ctx.events))
    result = next(e["result"] for e in ctx.events if e["state"] == "done")
    assert (result["phase"], result["module"], result["step"]) == ("forward", "1", 1)
