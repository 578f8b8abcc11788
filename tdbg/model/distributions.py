"""Each layer's weight and gradient histograms, and each module's activation histograms, over
the counted steps, bounded, for the views."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tdbg.protocol.messages.histograms import N_BINS, Histograms, bin_labels
from tdbg.protocol.messages.results import Activations

HISTORY = 120  # counted steps kept per layer and kind: more than any terminal's columns
KINDS = ("grads", "weights", "activations")


@dataclass(frozen=True, slots=True)
class Counted:
    """One kind's histogram of one layer at one step."""

    step: int
    counts: tuple[int, ...]
    max: float  # the largest magnitude, over the layer whole (NaN: it holds a NaN)
    stride: int  # 1: every element counted; k: one in k


class LayerDistributions:
    """Per layer and kind (``weights``, ``grads``) the latest HISTORY histograms, oldest first;
    and per module (by name: a ReLU has no parameters, so no layer) the latest HISTORY
    histograms of its outputs, from the activation-statistics dive."""

    def __init__(self) -> None:
        self._series: dict[tuple[int, str], deque[Counted]] = {}
        self._outputs: dict[str, deque[Counted]] = {}  # in the order the modules came
        self.revision = 0  # changes with each message added

    @classmethod
    def of(
        cls, messages: Iterable[Histograms], activations: Iterable[Activations] = ()
    ) -> LayerDistributions:
        out = cls()
        for message in messages:
            out.add(message)
        for sample in activations:
            out.add_activations(sample)
        return out

    def add_activations(self, sample: Activations) -> None:
        """An ``activations`` sample's histograms (none in one from before they were sent)."""
        if sample.step is None or not sample.hist:
            return
        for k, (name, counts) in enumerate(zip(sample.names, sample.hist, strict=False)):
            if counts is None:
                continue
            series = self._outputs.get(name)
            if series is None:
                series = self._outputs[name] = deque(maxlen=HISTORY)
            if series and series[-1].step >= sample.step:
                continue  # a replayed sample already folded in
            low, high = sample.min[k], sample.max[k]
            top = math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)
            stride = sample.hist_stride[k] if k < len(sample.hist_stride) else 1
            series.append(Counted(sample.step, counts, top, stride))
        self.revision += 1

    def modules(self) -> list[str]:
        """The modules with any activation histogram, in the order they were first seen."""
        return list(self._outputs)

    def outputs(self, name: str) -> list[Counted]:
        return list(self._outputs.get(name, ()))

    def add(self, message: Histograms) -> None:
        for h in message.layers:
            for kind, counts, top in (
                ("weights", h.weights, h.weight_max),
                ("grads", h.grads, h.grad_max),
            ):
                if counts is None:
                    continue
                series = self._series.get((h.layer, kind))
                if series is None:
                    series = self._series[(h.layer, kind)] = deque(maxlen=HISTORY)
                if series and series[-1].step >= message.step:
                    continue  # a replayed message already folded in
                series.append(Counted(message.step, counts, top, h.stride))
        self.revision += 1

    def layers(self) -> list[int]:
        """The layers with any histogram, in model order."""
        return sorted({layer for layer, _ in self._series})

    def series(self, layer: int, kind: str) -> list[Counted]:
        return list(self._series.get((layer, kind), ()))

    def __bool__(self) -> bool:
        return bool(self._series) or bool(self._outputs)


def per_decade(counts: np.ndarray) -> np.ndarray:
    """Bins x steps with the half-decade bins merged in pairs (a short terminal): 0, <1e-8,
    one row per decade, >=1e3, non-finite."""
    inner = counts[2 : N_BINS - 2]
    merged = inner[0::2] + inner[1::2]
    return np.concatenate([counts[:2], merged, counts[N_BINS - 2 :]])


def decade_labels() -> tuple[str, ...]:
    labels = bin_labels()
    return (*labels[:2], *labels[2 : N_BINS - 2 : 2], *labels[N_BINS - 2 :])


def fractions(series: list[Counted]) -> np.ndarray:
    """Bins x steps: each step's counts as a share of its elements counted (0 where none)."""
    if not series:
        return np.zeros((N_BINS, 0))
    counts = np.array([c.counts for c in series], dtype=np.float64).T
    totals = counts.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(totals > 0, counts / np.where(totals > 0, totals, 1), 0.0)
    return shares
