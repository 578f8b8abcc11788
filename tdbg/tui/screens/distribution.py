"""DistributionScreen: one layer's weight or gradient magnitudes, or one module's output
magnitudes, over the counted steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Static

from tdbg.format import fmt
from tdbg.model.model_summary import model_summary
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.distribution_map import DistributionMap

REPAINT = 0.5  # seconds between looks at the run's state (live: new steps counted)
NAMES = {"grads": "gradients", "weights": "weights", "activations": "outputs"}
NEXT_KIND = {"grads": "weights", "weights": "activations", "activations": "grads"}


class DistributionScreen(Screen[None]):
    """The histogram of |x| per counted step for one layer: ``w`` goes from gradients to
    weights to activations (a module's outputs, sampled by the activation-statistics dive: a
    ReLU has no parameters, so modules, not layers) and back, ``[`` ``]`` the layer or module
    (among those with histograms), escape goes back. It reads the run's state through
    ``source`` (live, or a replay's cursor) on a timer."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Back"),
        Binding("g", "close", "Back", show=False),
        Binding("w", "switch_kind", "Gradients / weights / activations"),
        Binding("left_square_bracket", "layer(-1)", "Previous layer"),
        Binding("right_square_bracket", "layer(1)", "Next layer"),
    ]
    DEFAULT_CSS = """
    DistributionScreen #dist-title { text-style: bold; color: $accent; }
    DistributionScreen #dist-foot, DistributionScreen #dist-hint { color: $foreground-muted; }
    """

    def __init__(self, source: Callable[[], RunState | None], layer: int | None) -> None:
        super().__init__()
        self._source = source
        self.shown_layer = layer
        self.kind = "grads"
        self.shown_module: str | None = None  # for activations
        self._seen: tuple[int, int, int | str, str] | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="dist-title")
        yield DistributionMap(id="dist-map")
        yield Static("", id="dist-foot")
        yield Static(
            "w grads/weights/outputs · [ ] layer · share of elements ░<1% ▒<10% ▓<50% █ · esc",
            id="dist-hint",
        )

    def on_mount(self) -> None:
        self.repaint()
        self.set_interval(REPAINT, self.repaint)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_switch_kind(self) -> None:
        self.kind = NEXT_KIND[self.kind]
        self.repaint(force=True)

    def action_layer(self, step: int) -> None:
        state = self._source()
        if state is None:
            return
        if self.kind == "activations":
            modules = state.distributions.modules()
            if modules:
                k = modules.index(self.shown_module) if self.shown_module in modules else -step
                self.shown_module = modules[(k + step) % len(modules)]
                self.repaint(force=True)
            return
        layers = state.distributions.layers()
        if not layers:
            return
        if self.shown_layer not in layers:
            self.shown_layer = layers[0]
        else:
            self.shown_layer = layers[(layers.index(self.shown_layer) + step) % len(layers)]
        self.repaint(force=True)

    def repaint(self, force: bool = False) -> None:
        state = self._source()
        if state is None:
            return
        dists = state.distributions
        layers = dists.layers()
        if layers and self.shown_layer is None:
            self.shown_layer = layers[0]
        if self.kind == "activations":
            self._pick_module(state)
        shown: int | str = -1 if self.shown_layer is None else self.shown_layer
        if self.kind == "activations":
            shown = self.shown_module or ""
        key = (id(state), dists.revision, shown, self.kind)
        if key == self._seen and not force:
            return
        self._seen = key
        title = self.query_one("#dist-title", Static)
        foot = self.query_one("#dist-foot", Static)
        chart = self.query_one(DistributionMap)
        if self.kind == "activations":
            self._show_outputs(state, title, foot, chart)
            return
        if self.shown_layer is None or not layers:
            title.update("Distributions: no histogram yet")
            foot.update("they come with sampled steps (a share of them, their cost bounded)")
            chart.show([])
            return
        names = state.layer_names
        name = (
            names[self.shown_layer]
            if self.shown_layer < len(names)
            else f"layer {self.shown_layer}"
        )
        series = dists.series(self.shown_layer, self.kind)
        what = NAMES[self.kind]
        if not series:
            title.update(f"|{what}| of {name}: no histogram")
            chart.show([])
            foot.update(f"{uncounted_reason(state, name)} · [ ] the {len(layers)} counted layers")
            return
        last = series[-1]
        steps = "step" if len(series) == 1 else "steps"
        counted = f"{len(series)} counted {steps} {series[0].step}–{last.step}"
        where = f"layer {layers.index(self.shown_layer) + 1} of {len(layers)}"
        title.update(f"|{what}| of {name} ({where}) · {counted}")
        sampled = "every element" if last.stride == 1 else f"one element in {last.stride}"
        top = "NaN or Inf" if math.isnan(last.max) else fmt(last.max)
        foot.update(f"step {last.step}: max |x| {top} · {sampled} counted")
        chart.show(series)

    def _pick_module(self, state: RunState) -> None:
        """The module shown: kept while it has histograms; else the one named as the shown
        layer (its outputs), else the first."""
        modules = state.distributions.modules()
        if self.shown_module in modules or not modules:
            return
        names = state.layer_names
        layer = self.shown_layer
        name = names[layer] if layer is not None and layer < len(names) else None
        self.shown_module = name if name in modules else modules[0]

    def _show_outputs(
        self, state: RunState, title: Static, foot: Static, chart: DistributionMap
    ) -> None:
        modules = state.distributions.modules()
        name = self.shown_module
        if name is None or not modules:
            title.update("|outputs|: no activation histogram yet")
            foot.update("s turns on activation statistics: they come with its sampled steps")
            chart.show([])
            return
        series = state.distributions.outputs(name)
        last = series[-1]
        steps = "step" if len(series) == 1 else "steps"
        counted = f"{len(series)} sampled {steps} {series[0].step}–{last.step}"
        where = f"module {modules.index(name) + 1} of {len(modules)}"
        sample = state.deep.activations  # the latest: its modules' types
        if sample is not None and name in sample.names:
            where = f"{sample.types[sample.names.index(name)]}, {where}"
        title.update(f"|outputs| of {name} ({where}) · {counted}")
        sampled = "every element" if last.stride == 1 else f"one element in {last.stride}"
        top = "NaN or Inf" if math.isnan(last.max) else fmt(last.max)
        total = sum(last.counts)
        zeros = f" · zeros {100 * last.counts[0] / total:.0f}%" if total else ""
        foot.update(f"step {last.step}: max |x| {top}{zeros} · {sampled} counted")
        chart.show(series)


def uncounted_reason(state: RunState, name: str) -> str:
    """Why a layer has no histogram, as the model summary knows it."""
    row = next((r for r in model_summary(state).rows if r.name == name), None)
    if row is not None and row.frozen:
        return "frozen: only the layers an optimizer updates are counted"
    if row is not None and "no optimizer" in row.marks:
        return "no optimizer updates it: histograms are counted at an optimizer's update"
    return "not counted yet: layers take turns, on a share of the sampled steps"
