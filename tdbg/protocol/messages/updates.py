"""``updates``: each measured layer's update ratio ‖Δw‖/‖w‖ at one sampled step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tdbg.protocol.messages.tolerant import as_float, as_int, as_list

# A healthy layer's update moves its weights by about a thousandth of their size a step; the
# alert thresholds (the probe's rules) and the TUI's colours read these.
TINY_RATIO = 1e-7  # below it, for many sampled steps while others learn: stopped learning
LARGE_RATIO = 0.1  # above it: an update that moves a tenth of the weights (LR far too high)


@dataclass(frozen=True)
class UpdateRatios:
    """The update ratios measured at ``step`` (exact for the update applied: the weights before
    it against after it), for ``layers`` (indices in the ``layers`` message's order): not every
    layer every time, the copy taken on a sampled step is bounded and the layers take turns.
    A ratio is NaN where the weights were zero or not finite; 0 where the update changed
    nothing (a learning rate of zero)."""

    step: int
    layers: tuple[int, ...]
    ratios: tuple[float, ...]
    history: bool = False

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "updates",
            "step": self.step,
            "layers": list(self.layers),
            "ratios": list(self.ratios),
        }
        if self.history:
            message["history"] = True
        return message

    @classmethod
    def from_wire(cls, message: Any) -> UpdateRatios | None:
        """What is well formed of an ``updates`` message (pairs with a bad index or value
        dropped); None without a step."""
        if not isinstance(message, dict):
            return None
        step = as_int(message.get("step"))
        if step is None or step < 0:
            return None
        layers: list[int] = []
        ratios: list[float] = []
        indices, values = as_list(message.get("layers")), as_list(message.get("ratios"))
        # Pairs: a list longer than the other (a malformed message) has no partner past it.
        for index, ratio in zip(indices, values, strict=False):
            i, r = as_int(index), as_float(ratio)
            if i is None or i < 0 or r is None or (math.isfinite(r) and r < 0):
                continue
            layers.append(i)
            ratios.append(r)
        return cls(step, tuple(layers), tuple(ratios), message.get("history") is True)
