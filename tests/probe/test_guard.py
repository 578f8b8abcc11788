"""watch(skip_nonfinite=True)'s guard skips a non-finite update and leaves the model bitwise intact;
find_forward_origin names the module whose forward overflowed, and changes nothing of the run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import linear_at
from torch import nn

import tdbg
from tdbg.probe.training import lean as lean_switch
from tdbg.probe.training.guard import NonfiniteGuard, find_forward_origin

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
}


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().clone())
    return tensors


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skipped_update_leaves_weights_and_state_bitwise_equal(name: str) -> None:
    model = net()
    opt = OPTIMIZERS[name](list(model.parameters()))
    layer_of = [0, 0, 1, 1]  # Linear 0 (weight, bias), Linear 2 (weight, bias)
    guard = NonfiniteGuard(list(model.parameters()), layer_of)
    for seed in range(2):  # optimizer state exists before the bad step
        opt.zero_grad()
        backward(model, seed)
        assert guard.check_and_skip() is False
        opt.step()
    before = snapshot(model, opt)
    opt.zero_grad()
    backward(model, 5)
    grad = linear_at(model, 2).bias.grad
    assert grad is not None
    grad[1] = float("inf")
    assert guard.check_and_skip() is True
    assert guard.nonfinite_layers == [1]
    assert guard.skipped == 1
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert same(before, snapshot(model, opt))
    # NaN in the first layer's weight gradient, the other layer finite
    backward(model, 6)
    grad = linear_at(model, 0).weight.grad
    assert grad is not None
    grad[0, 0] = float("nan")
    assert guard.check_and_skip() is True
    assert guard.nonfinite_layers == [0]
    assert guard.skipped == 2
    opt.step()
    assert same(before, snapshot(model, opt))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_finite_steps_are_untouched(name: str) -> None:
    guarded, plain = net(), net()
    opt_g = OPTIMIZERS[name](list(guarded.parameters()))
    opt_p = OPTIMIZERS[name](list(plain.parameters()))
    guard = NonfiniteGuard(list(guarded.parameters()))
    for seed in range(3):
        for model, opt in ((guarded, opt_g), (plain, opt_p)):
            opt.zero_grad()
            backward(model, seed)
        grads = [p.grad for p in guarded.parameters()]
        values = [g.clone() for g in grads if g is not None]
        assert guard.check_and_skip() is False
        assert [p.grad for p in guarded.parameters()] == grads  # the same tensors
        assert same(values, [p.grad.clone() for p in guarded.parameters() if p.grad is not None])
        opt_g.step()
        opt_p.step()
    assert same(snapshot(guarded, opt_g), snapshot(plain, opt_p))
    assert guard.skipped == 0 and guard.nonfinite_layers == []


def test_large_finite_gradients_are_not_skipped() -> None:
    """The check is a max-magnitude norm: values whose 2-norm would overflow are still finite."""
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3e38)
    h = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    h.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    guard = NonfiniteGuard([p, h])
    assert guard.check_and_skip() is False
    assert p.grad is not None and h.grad is not None


def test_large_finite_float64_gradients_are_not_skipped() -> None:
    """A float64 gradient whose 2-norm overflows float64 (values near 1e200) is finite: not a
    skip (its 2-norm in float64 read inf)."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.full((4,), 1e200, dtype=torch.float64)
    guard = NonfiniteGuard([p])
    assert guard.check_and_skip() is False and p.grad is not None
    p.grad = torch.tensor([1e200, float("inf"), 0.0, 1.0], dtype=torch.float64)
    assert guard.check_and_skip() is True and p.grad is None


@pytest.mark.parametrize("lean_on", [True, False], ids=["lean", "whole way"])
def test_a_parameter_the_optimizer_holds_outside_the_model_is_guarded_too(
    runtime_dir: Path, probe_reader: Any, monkeypatch: pytest.MonkeyPatch, lean_on: bool
) -> None:
    """``watch(model, opt, skip_nonfinite=True)`` where ``opt`` also updates a parameter the
    model does not hold (CLIP's logit scale, a learnable temperature): a non-finite update is
    skipped for it too, and the alert names it (only the model's was: the update wrote NaN
    into it, every later step's gradient was NaN, and every later update was skipped)."""
    monkeypatch.setattr(lean_switch, "ENABLED", lean_on)
    model = net()
    temperature = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.05)
    probe = tdbg.watch(model, opt, name="guarded", grad_every=1, skip_nonfinite=True)
    reader = probe_reader(probe)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    for step in range(5):
        opt.zero_grad()
        scale = temperature * (float("nan") if step == 2 else 1.0)
        loss = ((model(x) * scale - y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    reader.wait(lambda r: len(r.records()) >= 5)
    reader.settle()
    probe.close()
    assert torch.isfinite(temperature).all() and temperature.item() != 1.0  # stepped, finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
    skipped = [a for a in reader.of("alert") if a["kind"] == "skipped_nonfinite"]
    assert [a["step"] for a in skipped] == [2]  # the NaN update only
    assert "parameters outside the watched model" in skipped[0]["message"]


def test_no_gradients_is_not_a_skip() -> None:
    guard = NonfiniteGuard(list(net().parameters()))
    assert guard.check_and_skip() is False


class Boom(nn.Module):
    """Multiplies by 1e30 twice when armed: inf in float32 from finite inputs, no weights."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            x = x * 1e30 * 1e30
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.boom = Boom()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc2(self.boom(self.drop(self.fc1(x)))) * scale


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def test_forward_origin_names_the_overflowing_module() -> None:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    assert find_forward_origin(model, (x,), {"scale": 2.0}) is None  # finite
    model.boom.armed = True
    found = find_forward_origin(model, (x,), {"scale": 2.0})
    assert found is not None
    name, type_name, count = found
    assert (name, type_name) == ("boom", "Boom")
    assert count > 0


def test_forward_origin_keeps_rng_modes_and_hooks() -> None:
    torch.manual_seed(1)
    model = Net()
    model.train()
    model.fc2.eval()
    model.boom.armed = True
    hooks = hook_counts(model)
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    expected = torch.rand(3)  # what the run would draw next
    torch.set_rng_state(state)
    assert find_forward_origin(model, (x,)) is not None
    assert torch.equal(torch.rand(3), expected)  # the dropout re-run drew nothing of the run's
    assert model.training and model.fc1.training and not model.fc2.training
    assert hook_counts(model) == hooks


def test_forward_origin_never_raises() -> None:
    model = Net()
    hooks = hook_counts(model)
    x = torch.randn(3, 5)
    state = torch.get_rng_state()
    assert find_forward_origin(model, (x,)) is None  # shape error inside
    assert hook_counts(model) == hooks
    assert torch.equal(torch.get_rng_state(), state)


def test_forward_origin_inputs_already_nonfinite() -> None:
    model = Net()
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    assert find_forward_origin(model, (x,)) is None  # the data, not a module


def test_guard_copy_of_params_is_its_own_list() -> None:
    model = net()
    params: list[Any] = list(model.parameters())
    guard = NonfiniteGuard(params)
    params.clear()
    assert len(guard.params) == 4
    assert copy.copy(guard.params) == guard.params
