"""The test oracle for gradient norms: the slow, obvious computation the fused one must equal."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class HasParams(Protocol):
    @property
    def params(self) -> Sequence[Any]: ...


def reference_norms(layers: Iterable[HasParams]) -> tuple[float, list[float]]:
    """(total, per layer) from ``p.grad.norm()`` per parameter, in float64."""
    per_layer = []
    for layer in layers:
        sq = 0.0
        for p in layer.params:
            if p.grad is not None:
                sq += float(p.grad.detach().double().norm()) ** 2
        per_layer.append(sq**0.5)
    return sum(v * v for v in per_layer) ** 0.5, per_layer
