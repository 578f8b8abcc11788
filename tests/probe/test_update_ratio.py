"""Update ratios ‖Δw‖/‖w‖: exact for the update applied, for every kind of optimizer, on real
loops; the layers that stop learning and the updates too large are alerted."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tdbg
from tdbg.probe.training import update_ratio
from tdbg.probe.training.gradients import GradientStats, find_layers
from tdbg.probe.training.update_ratio import UpdateRatios
from tdbg.recording.reader import Recording


@pytest.fixture
def every_sampled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ratios measured on every sampled step (by default their cost is bounded by the
    passes': on one sampled step in several where the copy is large; see the last test)."""
    monkeypatch.setattr(update_ratio, "RATIO_SHARE", 1e9)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _run(
    tmp_path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 6
) -> tuple[list[dict[int, float]], list[dict[str, Any]]]:
    """Train with every step sampled; returns the ratios measured by hand around each update
    (per layer index) and the recording's messages."""
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(model, optimizers, serve=False, record=path, grad_every=1)
    layers = find_layers(model)
    expected: list[dict[int, float]] = []
    for _ in range(steps):
        x = torch.randn(8, 6)
        loss = model(x).pow(2).mean()
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        before = [[p.detach().clone() for p in layer.params] for layer in layers]
        for opt in optimizers:
            opt.step()
        probe.step(loss)
        row = {}
        for i, layer in enumerate(layers):
            moved = sum(
                float(((b - p.detach()) ** 2).sum())
                for b, p in zip(before[i], layer.params, strict=True)
            )
            size = sum(float((b**2).sum()) for b in before[i])
            row[i] = math.sqrt(moved) / math.sqrt(size)
        expected.append(row)
    probe.close()
    return expected, list(Recording(path).messages())


def _measured(messages: list[dict[str, Any]]) -> list[dict[int, float]]:
    return [
        dict(zip(m["layers"], m["ratios"], strict=True))
        for m in messages
        if m.get("type") == "updates"
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=False),
    ],
    ids=["sgd-nesterov", "adamw-decay", "adam-foreach", "adam-fused", "rmsprop"],
)
@pytest.mark.usefixtures("every_sampled_step")
def test_each_optimizer_s_ratios_are_the_update_it_applied(tmp_path: Path, make: Any) -> None:
    model = _model()
    expected, messages = _run(tmp_path, model, [make(model.parameters())])
    measured = _measured(messages)
    assert len(measured) == len(expected)
    for want, got in zip(expected, measured, strict=True):
        assert set(got) == set(want)
        for layer, ratio in want.items():
            assert got[layer] == pytest.approx(ratio, rel=1e-4, abs=1e-9)


@pytest.mark.usefixtures("every_sampled_step")
def test_two_optimizers_a_frozen_layer_and_a_zero_learning_rate(tmp_path: Path) -> None:
    model = _model()
    model[0].requires_grad_(False)  # frozen: not measured at all
    slow = torch.optim.SGD(model[2].parameters(), lr=0.0)  # learns nothing: ratio 0, flagged
    fast = torch.optim.Adam(model[4].parameters(), lr=1e-2)
    expected, messages = _run(tmp_path, model, [slow, fast], steps=8)
    measured = _measured(messages)
    for want, got in zip(expected, measured, strict=True):
        assert set(got) == {1, 2}  # the layers' indices: 0 is the frozen one
        assert got[1] == 0.0 and got[2] == pytest.approx(want[2], rel=1e-4)
    alerts = [m for m in messages if m.get("type") == "alert" and m["kind"] == "update_stalled"]
    assert len(alerts) == 1 and alerts[0]["layers"] == ["2"] and alerts[0]["step"] == 4


@pytest.mark.usefixtures("every_sampled_step")
def test_an_update_far_too_large_is_alerted(tmp_path: Path) -> None:
    model = _model()
    _, messages = _run(tmp_path, model, [torch.optim.SGD(model.parameters(), lr=50.0)], steps=3)
    large = [m for m in messages if m.get("type") == "alert" and m["kind"] == "update_large"]
    assert large and "learning rate too high" in large[0]["message"]


def test_a_large_model_s_layers_take_turns_within_the_copy_bound() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))  # 1,088 bytes a layer
    stats = GradientStats(find_layers(model))
    ratios = UpdateRatios(stats, copy_bytes=2 * 1088)
    seen: list[list[int]] = []
    for _ in range(4):
        assert ratios.begin() > 0
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)  # every weight moves by 1 %
        result, took = ratios.finish()
        assert result is not None and took > 0
        layers, values = result
        seen.append(layers)
        assert values.tolist() == pytest.approx([0.01] * len(layers), rel=1e-4)
    assert seen == [[0, 1], [2, 3], [4, 5], [0, 1]]  # two layers a turn, round and round
    too_big = UpdateRatios(stats, copy_bytes=100)  # no layer fits: none measured, no copy
    assert too_big.begin() == 0.0
    assert too_big.finish() == (None, 0.0)


def test_the_ratios_cost_at_most_a_share_of_the_passes() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    ratios = UpdateRatios(GradientStats(find_layers(model)))
    measured = 0
    for _ in range(400):  # passes of 0.1 ms; a measurement takes 1 ms
        if ratios.due(1e-4):
            measured += 1
            ratios.spent(1e-3)
    # A quarter of the passes' 40 ms pays for the ratios: 10 measurements (the first free).
    assert measured == pytest.approx(400 * 1e-4 * update_ratio.RATIO_SHARE / 1e-3, abs=1)


@pytest.mark.usefixtures("every_sampled_step")
def test_a_copy_that_runs_out_of_memory_turns_the_ratios_off_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(self: UpdateRatios) -> float:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")

    monkeypatch.setattr(UpdateRatios, "begin", no_memory)
    model = _model()
    _, messages = _run(tmp_path, model, [torch.optim.Adam(model.parameters())], steps=4)
    assert not _measured(messages)
    told = [m for m in messages if m.get("type") == "alert" and m["kind"] == "probe_error"]
    assert len(told) == 1 and "update ratios off" in told[0]["message"]
    steps = [m for m in messages if m.get("type") == "steps"]
    assert sum(m["n"] for m in steps) == 4  # every step recorded: the run went on


@pytest.mark.usefixtures("every_sampled_step")
def test_a_replay_shows_the_ratios_measured_up_to_its_cursor(tmp_path: Path) -> None:
    from tdbg.model.timeline import Timeline

    model = _model()
    _run(tmp_path, model, [torch.optim.SGD(model.parameters(), lr=0.1)], steps=6)
    timeline = Timeline(Recording(tmp_path / "run.tdbg"))
    at_two = timeline.state_at(2)
    assert {step for step, _ in at_two.update_ratio.values()} == {2}
    steps, rows = at_two.update_matrix()
    assert steps.tolist() == [0, 1, 2] and rows.shape == (3, 3)
    assert timeline.state_at(5).update_revision == 6
