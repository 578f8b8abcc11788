"""The distributions view: g opens the gradient table's layer's histograms over the counted
steps, w switches weights and gradients, [ ] the layer; live and in a replay's cursor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tui_app import painted, shows
from torch import nn
from waiting import wait_for

import tdbg
from tdbg.probe.training import histograms
from tdbg.protocol.messages.histograms import N_BINS, Histograms, LayerHistogram, bin_labels
from tdbg.protocol.messages.results import Activations
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.replay_app import ReplayApp, load
from tdbg.tui.screens.distribution import DistributionScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run


def _counts(**bins: int) -> tuple[int, ...]:
    counts = [0] * N_BINS
    for label, n in bins.items():
        counts[bin_labels().index(label.replace("_", "-").replace("p", "e"))] = n
    return tuple(counts)


def _histograms(step: int) -> dict[str, object]:
    # Layer 0: gradients all in [1e-3, 3e-3), weights half zero; layer 2: weights only.
    return Histograms(
        step,
        (
            LayerHistogram(
                0, _counts(**{"0": 50, "3e-1": 50}), _counts(**{"1e-3": 100}), 0.5, 2e-3
            ),
            LayerHistogram(2, _counts(**{"1e0": 10}), None, 1.5, float("nan"), stride=4),
        ),
    ).to_wire()


def _rows(text: str) -> dict[str, str]:
    """The map's rows by their bin label (the steps' axis line left out)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and set(parts[1]) <= set("·░▒▓█"):
            out[parts[0]] = line
    return out


async def test_g_shows_a_layer_s_gradients_then_its_weights_then_the_next_layer() -> None:
    messages = [*synthetic_run(steps=40, n_layers=4), *(_histograms(s) for s in range(0, 40, 5))]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.distributions.revision == 8, "histograms read")
        await painted(pilot, app)
        await pilot.press("g")
        await wait_for(pilot, lambda: isinstance(app.screen, DistributionScreen), "the view")
        text = await shows(pilot, app, "|gradients| of", "8 counted steps 0–35")
        rows = _rows(text)
        # All of the gradients in one bin: a full cell there on every step, a dot elsewhere.
        assert rows["1e-3"].split()[1] == "█" * 8 and rows["3e-3"].split()[1] == "·" * 8
        assert "every element counted" in text
        await pilot.press("w")
        text = await shows(pilot, app, "|weights| of")
        rows = _rows(text)
        assert rows["0"].split()[1] == "█" * 8 and rows["3e-1"].split()[1] == "█" * 8
        await pilot.press("right_square_bracket")
        text = await shows(pilot, app, "one element in 4 counted")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, DistributionScreen), "back")


async def test_a_short_terminal_merges_the_bins_into_decades() -> None:
    messages = [*synthetic_run(steps=10, n_layers=2), _histograms(3)]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: bool(app.state.distributions), "histograms read")
        await painted(pilot, app)
        await pilot.press("g")
        text = await shows(pilot, app, "|gradients| of")
        labels = [line.split()[0] for line in text.splitlines()[1:17] if line.strip()]
        assert "3e-3" not in labels and "1e-3" in labels and "nan" in labels
        assert screen_text(app).count("\n") <= 24


async def test_without_histograms_it_says_so() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=10, n_layers=2), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await painted(pilot, app)
        await pilot.press("g")
        await shows(pilot, app, "Distributions: no histogram yet")


def _activations(step: int) -> dict[str, object]:
    # Two modules: "relu" half zeros, half in [1e-1, 3e-1); "tanh" all at 1 (saturated).
    return Activations(
        step,
        ("relu", "tanh"),
        ("ReLU", "Tanh"),
        mean=(0.1, 0.0),
        std=(0.1, 1.0),
        min=(0.0, -1.0),
        max=(0.2, 1.0),
        zero_frac=(0.5, 0.0),
        nonfinite=(0, 0),
        hist=(_counts(**{"0": 64, "1e-1": 64}), _counts(**{"1e0": 128})),
        hist_stride=(1, 3),
    ).to_wire()


async def test_w_reaches_the_modules_outputs_and_the_brackets_go_through_them() -> None:
    messages = [
        *synthetic_run(steps=40, n_layers=4),
        *(_histograms(s) for s in range(0, 40, 5)),
        *(_activations(s) for s in range(2, 40, 10)),
    ]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.state.distributions.modules()) == 2, "samples read")
        await painted(pilot, app)
        await pilot.press("g")
        await wait_for(pilot, lambda: isinstance(app.screen, DistributionScreen), "the view")
        await shows(pilot, app, "|gradients| of")
        await pilot.press("w", "w")
        text = await shows(
            pilot, app, "|outputs| of relu (ReLU, module 1 of 2)", "4 sampled steps 2–32"
        )
        rows = _rows(text)
        assert rows["0"].split()[1] == "█" * 4 and rows["1e-1"].split()[1] == "█" * 4
        assert "zeros 50%" in text and "every element counted" in text
        await pilot.press("right_square_bracket")
        text = await shows(pilot, app, "|outputs| of tanh (Tanh, module 2 of 2)")
        assert _rows(text)["1e0"].split()[1] == "█" * 4
        assert "max |x| 1" in text and "one element in 3 counted" in text
        await pilot.press("w")
        await shows(pilot, app, "|gradients| of")


async def test_without_activation_samples_the_outputs_say_how_to_get_them() -> None:
    messages = [*synthetic_run(steps=10, n_layers=2), _histograms(3)]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: bool(app.state.distributions), "histograms read")
        await painted(pilot, app)
        await pilot.press("g", "w", "w")
        await shows(pilot, app, "no activation histogram yet", "s turns on activation")


async def test_a_layer_without_histograms_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run: a frozen layer, one no optimizer updates, one that learns. g on each says
    why it has none, or shows its own; [ ] go through the counted ones."""
    monkeypatch.setattr(histograms, "HISTOGRAM_SHARE", 1e9)
    torch.manual_seed(0)
    frozen, orphan, learns = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    frozen.requires_grad_(False)
    model = nn.Sequential(frozen, orphan, learns)
    opt = torch.optim.SGD(learns.parameters(), lr=1e-2)
    path = tmp_path / "run.tdbg"
    probe = tdbg.watch(model, opt, serve=False, record=path, grad_every=1)
    for _ in range(4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss)
    probe.close()
    app = ReplayApp(load(str(path)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.settled, "the replay painted")
        for layer, words in (
            (0, "frozen: only the layers an optimizer updates are counted"),
            (1, "no optimizer updates it"),
        ):
            names = app.state.layer_names
            app.push_screen(DistributionScreen(lambda: app.state, layer))
            await shows(pilot, app, f"|gradients| of {names[layer]}: no histogram", words)
            await pilot.press("right_square_bracket")
            await shows(pilot, app, "|gradients| of 2 (layer 1 of 1)")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, DistributionScreen), "back")
