"""What sampled steps measure beyond their row (update ratios, histograms): sent, kept, replayed."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from tdbg.probe.training.pending import PendingStep
from tdbg.protocol.messages.histograms import Histograms, LayerHistogram
from tdbg.protocol.messages.updates import UpdateRatios

RECENT_UPDATES = 256  # sampled steps' update ratios replayed to a client attaching later
# Sampled steps' histograms replayed to a client attaching later: each is ~26 counts a kind
# a layer, so fewer of them (the TUI's view shows the latest few dozen per layer).
RECENT_HISTOGRAMS = 64


def histograms_message(step: int, pending: PendingStep) -> Histograms | None:
    """The ``histograms`` message of a resolved step that counted them; None otherwise."""
    part, values = pending.histograms, pending.histogram_values
    if part is None or values is None:
        return None
    layers = tuple(
        LayerHistogram(layer, tuple(w), None if g is None else tuple(g), wmax, gmax, stride)
        for layer, w, g, wmax, gmax, stride in part.read(values)
    )
    return Histograms(step, layers)


class SampledFeed:
    """The latest update ratios and histograms (one message per sampled step that measured
    them), bounded, for the clients that attach later."""

    def __init__(self) -> None:
        self.updates: deque[UpdateRatios] = deque(maxlen=RECENT_UPDATES)
        self.histograms: deque[Histograms] = deque(maxlen=RECENT_HISTOGRAMS)

    def take(
        self, step: int, pending: PendingStep
    ) -> tuple[UpdateRatios | None, Histograms | None]:
        """What a resolved step measured, kept for the replay."""
        measured = counted = None
        if pending.update_layers is not None and pending.update_values is not None:
            measured = UpdateRatios(
                step, tuple(pending.update_layers), tuple(pending.update_values)
            )
            self.updates.append(measured)
        if pending.histograms is not None:
            counted = histograms_message(step, pending)
            if counted is not None:
                self.histograms.append(counted)
        return measured, counted

    def replay(self) -> list[dict[str, Any]]:
        out = [replace(u, history=True).to_wire() for u in self.updates]
        out.extend(replace(h, history=True).to_wire() for h in self.histograms)
        return out
