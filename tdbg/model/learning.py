"""Whether each layer learned, over a run: its update ratios and weight histograms, for reports."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tdbg.model.run_state import RunState
from tdbg.protocol.messages.histograms import BIN_EDGES, NONFINITE_BIN

# Weights "at zero": exactly 0 or under 1e-8 (the histograms' first two bins).
NEAR_ZERO_BINS = 2
# A layer's weights are collapsing when at least this share of them is at zero at its latest
# counted step, and that share grew by at least COLLAPSE_GROWTH since its earliest one: a layer
# initialised that way (a zero bias, a pruned mask from the start) is not flagged.
COLLAPSED_SHARE = 0.5
COLLAPSE_GROWTH = 0.25
# A layer's gradients are concentrated in a few entries when its largest magnitude (read over
# the whole layer) is at least CONCENTRATED times the edge that 99 % of its non-zero counted
# entries stay under, as the median over at least CONCENTRATED_STEPS counted steps. The demo
# models' layers sit at 1-6x (benchmarks/README.md): a thousand is far outside healthy.
CONCENTRATED = 1e3
CONCENTRATED_STEPS = 3
BULK = 0.99


@dataclass(frozen=True)
class Collapse:
    """A layer whose weights moved to zero between two counted steps."""

    layer: str
    first_step: int
    first_share: float
    last_step: int
    last_share: float

    def words(self) -> str:
        return (
            f"{self.layer}: weights at 0 or under 1e-8 {self.first_share:.0%} at step "
            f"{self.first_step} → {self.last_share:.0%} at step {self.last_step}"
        )


def _near_zero(counts: tuple[int, ...]) -> float | None:
    total = sum(counts)
    return sum(counts[:NEAR_ZERO_BINS]) / total if total else None


def collapsing_weights(state: RunState) -> list[Collapse]:
    """The layers whose weight histograms moved to zero over the counted steps kept (the
    latest 120 a layer), in model order."""
    dists = state.distributions
    names = state.layer_names
    out: list[Collapse] = []
    for layer in dists.layers():
        series = dists.series(layer, "weights")
        if len(series) < 2:
            continue
        first, last = _near_zero(series[0].counts), _near_zero(series[-1].counts)
        if first is None or last is None:
            continue
        if last >= COLLAPSED_SHARE and last - first >= COLLAPSE_GROWTH:
            name = names[layer] if layer < len(names) else f"layer {layer}"
            out.append(Collapse(name, series[0].step, first, series[-1].step, last))
    return out


def ratio_evidence(state: RunState, layers: Iterable[str]) -> list[str]:
    """For each named layer, its update ratios over the run (their median, how many, the
    steps), beside the other layers' median: what an ``update_stalled`` or ``update_large``
    verdict rests on. Empty without update ratios."""
    steps, rows = state.update_history.matrix()
    if not len(steps) or not rows.size:
        return []
    index = {name: i for i, name in enumerate(state.layer_names)}
    chosen = [index[name] for name in layers if name in index and index[name] < rows.shape[1]]
    others = np.delete(rows, chosen, axis=1)
    rest = others[np.isfinite(others)]
    typical = f"; the other layers' median {_ratio(float(np.median(rest)))}" if rest.size else ""
    out: list[str] = []
    for i in chosen:
        column = rows[:, i]
        seen = np.isfinite(column)
        if not seen.any():
            continue
        measured = steps[seen]
        n = int(seen.sum())
        out.append(
            f"{state.layer_names[i]}: ‖Δw‖/‖w‖ median {_ratio(float(np.median(column[seen])))}"
            f" over {n} measurement{'s' if n > 1 else ''} (steps {int(measured[0])}–"
            f"{int(measured[-1])}){typical}"
        )
    return out


def _ratio(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return "0" if value == 0 else f"{value:.2g}"


@dataclass(frozen=True)
class Concentration:
    """A layer whose gradients' largest entries stood far above the rest of them."""

    layer: str
    ratio: float  # the median over its counted steps: largest / what 99 % stay under
    steps: int

    def words(self) -> str:
        return (
            f"{self.layer}: its largest |gradient| ~{self.ratio:.2g}× what 99 % of its non-zero "
            f"entries stay under (median over {self.steps} counted steps)"
        )


def bulk_edge(counts: tuple[int, ...]) -> float | None:
    """The edge under which BULK of the non-zero finite counted entries lie (the upper edge
    of the bin that reaches it); None without such entries or when it is the open top bin."""
    inner = counts[1:NONFINITE_BIN]  # from "under 1e-8" to ">= 1e3"
    total = sum(inner)
    if not total:
        return None
    reached = 0
    for k, n in enumerate(inner, start=1):
        reached += n
        if reached >= BULK * total:
            return BIN_EDGES[k - 1] if k - 1 < len(BIN_EDGES) else None
    return None


def concentrated_gradients(state: RunState) -> list[Concentration]:
    """The layers whose largest gradient entries stood CONCENTRATED times above the rest, on
    most of their counted steps, in model order."""
    dists = state.distributions
    names = state.layer_names
    out: list[Concentration] = []
    for layer in dists.layers():
        ratios = []
        for counted in dists.series(layer, "grads"):
            edge = bulk_edge(counted.counts)
            if edge is not None and math.isfinite(counted.max):
                ratios.append(counted.max / edge)
        if len(ratios) < CONCENTRATED_STEPS:
            continue
        median = float(np.median(ratios))
        if median >= CONCENTRATED:
            name = names[layer] if layer < len(names) else f"layer {layer}"
            out.append(Concentration(name, median, len(ratios)))
    return out
