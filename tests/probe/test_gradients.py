"""Fused per-layer gradient norms against the slow reference, on models with awkward parameters."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import linear_at
from norm_oracle import reference_norms
from torch import nn

from tdbg.probe.training.gradients import GradientStats, find_layers


def backward(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out.float() ** 2).mean().backward()


def fused(model: nn.Module) -> tuple[list, GradientStats, float, list[float], list[int]]:
    layers = find_layers(model)
    stats = GradientStats(layers)
    sample = stats.compute()
    values, total = sample.layer_norms()
    return layers, stats, total, list(values), sample.missing


def assert_matches_reference(model: nn.Module) -> tuple[list[str], list[float], list[int]]:
    layers, stats, total, per_layer, missing = fused(model)
    ref_total, ref_layers = reference_norms(layers)
    assert len(per_layer) == len(layers) == stats.n_layers
    assert total == pytest.approx(ref_total, rel=1e-5, abs=1e-7)
    assert per_layer == pytest.approx(ref_layers, rel=1e-5, abs=1e-7)
    return [layer.name for layer in layers], per_layer, missing


def test_small_mlp() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    backward(model, torch.randn(32, 5))
    names, per_layer, missing = assert_matches_reference(model)
    assert names == ["0", "2", "4"]
    assert all(v > 0 for v in per_layer)
    assert missing == []
    # a second call with the same plan gives the same answer (the plan is cached)
    layers = find_layers(model)
    stats = GradientStats(layers)
    first = stats.compute().layer_norms()[0]
    assert stats.replanned
    second = stats.compute().layer_norms()[0]
    assert not stats.replanned
    assert first == second


def test_norms_follow_new_gradients() -> None:
    torch.manual_seed(1)
    model = nn.Linear(3, 3)
    stats = GradientStats(find_layers(model))
    backward(model, torch.randn(4, 3))
    a = stats.compute().layer_norms()[0]
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(2.0)
    b = stats.compute().layer_norms()[0]
    assert list(b) == pytest.approx([2 * v for v in a], rel=1e-6)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(idx))))


def test_tied_parameters_are_counted_once() -> None:
    torch.manual_seed(2)
    model = Tied()
    backward(model, torch.randint(0, 10, (4, 5)))
    names, per_layer, missing = assert_matches_reference(model)
    # the shared weight belongs to the first module that owns it; head has nothing else
    assert names == ["embed", "hidden"]
    assert missing == []
    # the total counts the tied weight once
    grad = model.embed.weight.grad
    assert grad is not None
    assert per_layer[0] == pytest.approx(float(grad.norm()), rel=1e-5)


def test_frozen_layer_is_not_missing() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    backward(model, torch.randn(8, 4))
    names, per_layer, missing = assert_matches_reference(model)
    assert names == ["0", "2"]
    assert per_layer[0] == 0.0  # frozen on purpose: no norm, but not reported missing
    assert per_layer[1] > 0
    assert missing == []


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_layer_without_grad_is_missing() -> None:
    torch.manual_seed(4)
    model = Branchy()
    backward(model, torch.randn(5, 3))
    names, per_layer, missing = assert_matches_reference(model)
    assert names == ["used", "unused"]
    assert missing == [1]
    assert per_layer[1] == 0.0


def test_partially_missing_layer_is_missing() -> None:
    torch.manual_seed(5)
    model = nn.Linear(3, 3)
    backward(model, torch.randn(5, 3))
    model.bias.grad = None
    _, per_layer, missing = assert_matches_reference(model)
    assert missing == [0]
    assert per_layer[0] > 0  # the weight's gradient still counts


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.double()).float())


def test_mixed_dtypes() -> None:
    torch.manual_seed(6)
    model = Mixed()
    backward(model, torch.randn(6, 4))
    names, per_layer, _ = assert_matches_reference(model)
    assert names == ["a", "b"]
    assert all(v > 0 for v in per_layer)


def test_mixed_dtypes_within_one_layer() -> None:
    torch.manual_seed(7)
    model = nn.Linear(4, 4)
    model.bias.data = model.bias.data.double()
    model.weight.grad = torch.randn(4, 4)
    model.bias.grad = torch.randn(4, dtype=torch.float64)
    _, per_layer, _ = assert_matches_reference(model)
    expected = math.sqrt(float(model.weight.grad.norm()) ** 2 + float(model.bias.grad.norm()) ** 2)
    assert per_layer[0] == pytest.approx(expected, rel=1e-5)


def test_model_without_parameters() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Flatten())
    layers = find_layers(model)
    assert layers == []
    stats = GradientStats(layers)
    sample = stats.compute()
    norms, total = sample.layer_norms()
    assert len(norms) == 0 and total == 0.0
    assert sample.missing == []
    assert reference_norms(layers) == (0.0, [])


def test_no_gradients_yet_reports_every_layer_missing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    _, _, total, per_layer, missing = fused(model)
    assert total == 0.0 and per_layer == [0.0, 0.0]
    assert missing == [0, 1]


def test_root_module_with_own_parameters_is_named_after_its_class() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.child = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x * self.scale)

    model = Root()
    backward(model, torch.randn(2, 3))
    names, _, _ = assert_matches_reference(model)
    assert names == ["Root", "child"]


def test_non_finite_gradients_show_as_non_finite() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    backward(model, torch.randn(3, 2))
    grad = linear_at(model, 1).weight.grad
    assert grad is not None
    grad[0, 0] = math.nan
    _, _, total, per_layer, _ = fused(model)
    assert math.isfinite(per_layer[0])
    assert math.isnan(per_layer[1])
    assert math.isnan(total)


def test_the_gradient_pass_also_flags_non_finite_weights() -> None:
    """Weights are normed in the same fused call: a layer whose weights hold a NaN is named,
    on the host and after the device-layout join of several optimizers' samples."""
    from tdbg.probe.training.gradients import GradientStats, GradSample, find_layers

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    layers = find_layers(model)
    clean = GradientStats(layers).compute(weights=True)
    assert clean.weight_nonfinite() == []
    with torch.no_grad():
        linear_at(model, 2).bias[1] = float("nan")
    sample = GradientStats(layers).compute(weights=True)
    assert sample.weight_nonfinite() == [1]
    norms, _ = sample.layer_norms()
    assert all(v == v for v in norms)  # the gradients themselves are finite
    first = GradientStats(layers, {id(p) for p in model[0].parameters()}).compute(weights=True)
    second = GradientStats(layers, {id(p) for p in model[2].parameters()}).compute(weights=True)
    joined = GradSample.join([first, second])
    assert joined.weight_nonfinite() == [1]
    assert list(joined.layer_norms()[0]) == pytest.approx(list(norms))


def test_an_ordinary_pass_reads_no_weights_and_they_can_be_added_after() -> None:
    """The common pass norms the gradients only (half the bytes); a step found non-finite gets
    the weights' norms added, in the same order, the gradient norms unchanged."""
    from tdbg.probe.training.gradients import GradientStats, find_layers

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    with torch.no_grad():
        linear_at(model, 0).weight[0, 0] = float("inf")
    stats = GradientStats(find_layers(model))
    plain = stats.compute()
    assert not plain.weights and len(plain.values) == len(plain.layer_index)
    assert plain.weight_nonfinite() == []  # not measured: nothing claimed
    full = stats.with_weights(plain)
    assert full.weights and full.weight_nonfinite() == [0]
    assert list(full.layer_norms()[0]) == list(plain.layer_norms()[0])
    assert stats.with_weights(full) is full
