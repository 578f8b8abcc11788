"""Weight and gradient histograms on real loops: known values land in known bins, for every
kind of model the issue names (several optimizers, frozen, tied, sparse, complex, many layers)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tdbg
from tdbg.probe.training import histograms
from tdbg.protocol.messages.histograms import (
    BIN_EDGES,
    N_BINS,
    NONFINITE_BIN,
    ZERO_BIN,
    Histograms,
    bin_labels,
)
from tdbg.recording.reader import Recording


@pytest.fixture(autouse=True)
def every_sampled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Histograms on every sampled step (by default their cost is bounded by the passes')."""
    monkeypatch.setattr(histograms, "HISTOGRAM_SHARE", 1e9)


def _bin(label: str) -> int:
    return bin_labels().index(label)


def _run(
    tmp_path: Path,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batch: Any,
    steps: int = 3,
) -> list[dict[str, Any]]:
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(model, optimizers, serve=False, record=path, grad_every=1)
    for _ in range(steps):
        loss = batch(model)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        probe.step(loss)
    probe.close()
    return list(Recording(path).messages())


def _counted(messages: list[dict[str, Any]]) -> list[Histograms]:
    out = []
    for m in messages:
        if m.get("type") == "histograms":
            read = Histograms.from_wire(m)
            assert read is not None
            out.append(read)
    return out


def test_the_bins_are_fixed_and_labelled() -> None:
    assert N_BINS == 26 and len(bin_labels()) == N_BINS
    assert BIN_EDGES[0] == 1e-8 and BIN_EDGES[-1] == pytest.approx(1e3)
    codes = histograms.bin_codes(
        torch.tensor([0.0, 1e-9, 1e-8, 2e-8, 0.5, 1.0, 999.0, 1e3, 1e30, math.inf, math.nan])
    ).tolist()
    labels = [bin_labels()[c] for c in codes]
    assert (
        labels
        == ["0", "<1e-8", "1e-8", "1e-8", "3e-1", "1e0", "3e2", ">=1e3", ">=1e3"] + ["nan"] * 2
    )


def test_known_weights_and_gradients_give_known_bins(tmp_path: Path) -> None:
    """A layer set to 0.5 with a gradient of 1e-5 everywhere (sum of x * w, x = 1e-5); its
    bias exactly 0 with a gradient of 1: the counts say just that, on every step (lr = 0)."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    messages = _run(tmp_path, model, [opt], lambda m: m(torch.full((1, 4), 2e-5)).sum())
    counted = _counted(messages)
    assert [h.step for h in counted] == [0, 1, 2]
    for h in counted:
        (layer,) = h.layers
        assert layer.layer == 0 and layer.stride == 1
        weights = dict(enumerate(layer.weights or ()))
        grads = dict(enumerate(layer.grads or ()))
        assert {k: v for k, v in weights.items() if v} == {_bin("3e-1"): 12, ZERO_BIN: 3}
        assert {k: v for k, v in grads.items() if v} == {_bin("1e-5"): 12, _bin("1e0"): 3}
        assert layer.weight_max == 0.5 and layer.grad_max == pytest.approx(1.0)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _mse(m: nn.Module) -> torch.Tensor:
    out: torch.Tensor = m(torch.randn(8, 6)).pow(2).mean()
    return out


def test_adam_with_weight_decay_two_optimizers_and_a_frozen_backbone(tmp_path: Path) -> None:
    model = _mlp()
    model[0].requires_grad_(False)  # the frozen backbone: not counted
    adam = torch.optim.AdamW(model[2].parameters(), lr=1e-2, weight_decay=0.1)
    sgd = torch.optim.SGD(model[4].parameters(), lr=0.1, momentum=0.9)
    counted = _counted(_run(tmp_path, model, [adam, sgd], _mse, steps=4))
    assert len(counted) == 4
    for h in counted:
        assert sorted(layer.layer for layer in h.layers) == [1, 2]
        for layer in h.layers:
            numel = 12 * 12 + 12 if layer.layer == 1 else 12 * 3 + 3
            assert sum(layer.weights or ()) == numel and sum(layer.grads or ()) == numel
            assert (layer.weights or ())[NONFINITE_BIN] == 0


def test_tied_weights_are_counted_once(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.out(self.embed(x))
            return out

    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    counted = _counted(_run(tmp_path, model, [opt], lambda m: m(torch.tensor([1, 2, 3])).mean()))
    assert counted
    for h in counted:
        assert len(h.layers) == 1 and sum(h.layers[0].weights or ()) == 40


def test_a_sparse_gradient_is_said_once_and_its_weights_still_counted(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1))
    sparse = torch.optim.SGD(model[0].parameters(), lr=0.1)
    dense = torch.optim.SGD(model[1].parameters(), lr=0.1)
    messages = _run(
        tmp_path, model, [sparse, dense], lambda m: m(torch.tensor([1, 2])).sum(), steps=4
    )
    counted = _counted(messages)
    assert len(counted) == 4
    for h in counted:
        by_layer = {layer.layer: layer for layer in h.layers}
        assert by_layer[0].grads is None and sum(by_layer[0].weights or ()) == 80
        assert by_layer[1].grads is not None and sum(by_layer[1].grads) == 5
    said = [m for m in messages if m.get("type") == "alert" and "sparse" in m.get("message", "")]
    assert len(said) == 1


def test_complex_parameters_are_counted_by_their_modulus(tmp_path: Path) -> None:
    class Rotor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((5,), 3 + 4j, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).abs().sum()

    model = Rotor()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    counted = _counted(_run(tmp_path, model, [opt], lambda m: m(torch.ones(5))))
    assert counted
    (layer,) = counted[0].layers
    assert (layer.weights or ())[_bin("3e0")] == 5 and layer.weight_max == pytest.approx(5.0)


def test_a_large_layer_is_sampled_with_a_stride_its_max_and_nan_still_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(histograms, "LAYER_ELEMENTS", 100)
    model = nn.Linear(50, 20, bias=False)  # 1000 elements: one in 10 counted
    with torch.no_grad():
        model.weight.fill_(0.01)
        model.weight[0, 7] = 900.0  # off the stride: only the max sees it
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    counted = _counted(_run(tmp_path, model, [opt], lambda m: m(torch.ones(1, 50)).sum(), 2))
    (layer,) = counted[0].layers
    assert layer.stride == 10 and sum(layer.weights or ()) == 100
    assert (layer.weights or ())[_bin("1e-2")] == 100
    assert layer.weight_max == 900.0


def test_many_layers_take_turns_and_layers_added_mid_run_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(histograms, "PASS_ELEMENTS", 400)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    path = tmp_path / "run.tdbg"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = tdbg.watch(model, opt, serve=False, record=path, grad_every=1)
    for step in range(10):
        if step == 3:  # a new head, and an optimizer over it all
            model.append(nn.Linear(4, 2))
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss = model(torch.randn(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    counted = _counted(list(Recording(path).messages()))
    # 20 elements a layer, weights and gradients: ten layers a turn.
    turns = [[layer.layer for layer in h.layers] for h in counted]
    assert turns[:3] == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    head = [layer for h in counted if h.step > 3 for layer in h.layers if layer.layer == 30]
    assert head and sum(head[0].weights or ()) == 10 and sum(head[0].grads or ()) == 10


def test_a_client_attaching_later_gets_the_latest_histograms_bounded(tmp_path: Path) -> None:
    from tdbg.probe.serving.sampled_feed import RECENT_HISTOGRAMS, SampledFeed
    from tdbg.probe.training.gradients import GradientStats, find_layers
    from tdbg.probe.training.histograms import LayerHistograms
    from tdbg.probe.training.pending import PendingStep

    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    counter = LayerHistograms(GradientStats(find_layers(model)))
    feed = SampledFeed()
    for step in range(RECENT_HISTOGRAMS + 5):
        pending = PendingStep()
        pending.histograms, _ = counter.compute()
        assert pending.histograms is not None
        pending.histogram_values = pending.histograms.values.tolist()
        feed.take(step, pending)
    replayed = [m for m in feed.replay() if m["type"] == "histograms"]
    assert len(replayed) == RECENT_HISTOGRAMS and replayed[0]["step"] == 5
    assert all(m["history"] is True for m in replayed)
    read = Histograms.from_wire(replayed[-1])
    assert read is not None and sum(read.layers[0].weights or ()) == 8


def test_ten_thousand_layers_take_bounded_turns_without_an_error(tmp_path: Path) -> None:
    """The issue's bad input: 10,000 layers. Each counted step takes a turn of at most
    PASS_ELEMENTS elements, the turns go round the whole model, each message stays far under
    the 4 MiB frame, and the loop sees no error."""
    import msgpack

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(10_000)]  # 144 elements a layer
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(0.3)  # keep 10,000 layers' activations finite
    model = nn.Sequential(*layers)
    path = tmp_path / "run.tdbg"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = tdbg.watch(model, opt, serve=False, record=path, grad_every=1)
    for _ in range(8):
        loss = model(torch.randn(2, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)
    errors = probe.errors
    probe.close()
    assert errors == 0
    messages = [m for m in Recording(path).messages() if m.get("type") == "histograms"]
    counted = _counted(messages)
    per_turn = histograms.PASS_ELEMENTS // 144
    turns = [[layer.layer for layer in h.layers] for h in counted]
    assert len(turns) >= 6 and all(len(t) <= per_turn for t in turns)
    assert turns[0][0] == 0
    assert all(b[0] == (a[-1] + 1) % 10_000 for a, b in zip(turns, turns[1:], strict=False))
    assert set().union(*map(set, turns)) == set(range(10_000))
    assert max(len(msgpack.packb(m)) for m in messages) < 1 << 20
