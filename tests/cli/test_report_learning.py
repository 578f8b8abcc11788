"""tdbg report on whether the layers learned, from real runs' recordings: a layer frozen by a
learning rate of 0 is named with its update ratios beside the others'; weights that decay to
zero and gradients held by a few entries are verdicts of their own, read from the histograms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tdbg
from tdbg.cli.main import run
from tdbg.model.learning import collapsing_weights
from tdbg.model.recordings import load_run
from tdbg.probe.training import histograms, update_ratio


@pytest.fixture(autouse=True)
def every_sampled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ratios and histograms on every sampled step (by default their cost is bounded)."""
    monkeypatch.setattr(update_ratio, "RATIO_SHARE", 1e9)
    monkeypatch.setattr(histograms, "HISTOGRAM_SHARE", 1e9)


def _train(path: Path, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Path:
    probe = tdbg.watch(model, opt, serve=False, record=path, grad_every=1)
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    return path


def _verdicts(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert run(["report", "--json", str(path)]) == 0
    verdicts: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["verdicts"]
    return verdicts


def test_a_layer_with_a_learning_rate_of_zero_is_named_with_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    )
    groups: list[dict[str, Any]] = [
        {"params": model[0].parameters()},
        {"params": model[2].parameters(), "lr": 0.0},  # frozen by its learning rate
        {"params": model[4].parameters()},
    ]
    path = _train(tmp_path / "run.tdbg", model, torch.optim.AdamW(groups, lr=1e-2), steps=10)
    verdicts = _verdicts(path, capsys)
    [stalled] = [v for v in verdicts if "stopped learning" in v["headline"]]
    assert stalled["level"] == "warn"
    assert "layers: 2" in stalled["evidence"]
    [ratios] = [e for e in stalled["evidence"] if e.startswith("2: ‖Δw‖/‖w‖")]
    assert ratios.startswith("2: ‖Δw‖/‖w‖ median 0 over 10 measurements (steps 0–9)")
    assert "the other layers' median" in ratios
    assert not any(e.startswith(("0:", "4:")) for e in stalled["evidence"])
    # AdamW's decay at 1e-2 moves nothing to zero, and no gradient entry stands out.
    assert not [v for v in verdicts if v["headline"].startswith("weights collapsing")]
    assert not [v for v in verdicts if v["headline"].startswith("gradients concentrated")]

    assert run(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "stopped learning" in text and "2: ‖Δw‖/‖w‖ median 0 over 10 measurements" in text


def test_weights_decayed_to_zero_are_a_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(1)
    first, last = nn.Linear(6, 12), nn.Linear(12, 3)
    model = nn.Sequential(first, nn.Tanh(), last)
    # The first layer's weights get a zero gradient (the layer after it has zero weights, kept
    # there) and a weight decay that keeps a tenth of them a step: under 1e-8 in ten steps.
    last.weight.requires_grad_(False)
    with torch.no_grad():
        last.weight.zero_()
    groups: list[dict[str, Any]] = [
        {"params": first.parameters(), "lr": 1.0, "weight_decay": 0.9},
        {"params": [last.bias], "lr": 1e-2},
    ]
    path = _train(tmp_path / "decay.tdbg", model, torch.optim.SGD(groups), steps=14)
    verdicts = _verdicts(path, capsys)
    [collapsed] = [v for v in verdicts if v["headline"].startswith("weights collapsing")]
    assert collapsed["headline"] == (
        "weights collapsing to zero in 1 layer (weight decay too strong? dead units?)"
    )
    [words] = collapsed["evidence"]
    assert words.startswith("0: weights at 0 or under 1e-8 0% at step 0 → 100% at step 13")


def test_a_layer_that_starts_at_zero_is_not_collapsing(tmp_path: Path) -> None:
    torch.manual_seed(2)
    first, last = nn.Linear(6, 12), nn.Linear(12, 3)
    model = nn.Sequential(first, nn.Tanh(), last)
    with torch.no_grad():
        first.weight.zero_()  # zero from the start, and kept there (lr 0)
        first.bias.zero_()
    groups: list[dict[str, Any]] = [
        {"params": first.parameters(), "lr": 0.0},
        {"params": last.parameters()},
    ]
    path = _train(tmp_path / "zero.tdbg", model, torch.optim.SGD(groups, lr=1e-2), steps=6)
    state = load_run(path)
    assert len(state.distributions.series(0, "weights")) >= 2
    assert collapsing_weights(state) == []


def test_gradients_held_by_a_few_entries_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One input feature ten thousand times the others: the first layer's gradient column for
    it (64 of 16,448 entries) dwarfs the rest, step after step."""
    torch.manual_seed(3)
    first, last = nn.Linear(256, 64), nn.Linear(64, 3)
    model = nn.Sequential(first, nn.Tanh(), last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    path = tmp_path / "spiky.tdbg"
    probe = tdbg.watch(model, opt, serve=False, record=path, grad_every=1)
    for _ in range(6):
        x = torch.randn(32, 256) * 1e-2
        x[:, 0] = 100.0
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    verdicts = _verdicts(path, capsys)
    [spiky] = [v for v in verdicts if v["headline"].startswith("gradients concentrated")]
    assert spiky["headline"] == "gradients concentrated in a few entries in 1 layer"
    assert spiky["evidence"][0].startswith("0: its largest |gradient| ~")
    ratio = float(spiky["evidence"][0].split("~")[1].split("×")[0])
    assert ratio >= 1e3
