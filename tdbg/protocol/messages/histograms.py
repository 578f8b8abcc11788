"""``histograms``: per-layer weight and gradient magnitude histograms at one sampled step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tdbg.protocol.messages.tolerant import as_float, as_int, as_list

# The bins, fixed for every step and every run (so that steps and runs compare), over |x|:
#   0: exactly zero; 1: 0 < |x| < 1e-8; then two per decade, [1e-8, 10^-7.5), ...,
#   [10^2.5, 1e3); then |x| >= 1e3; last: NaN or +-Inf. 26 bins.
LOW_DECADE, HIGH_DECADE, PER_DECADE = -8, 3, 2
BIN_EDGES: tuple[float, ...] = tuple(
    10.0 ** (LOW_DECADE + k / PER_DECADE)
    for k in range((HIGH_DECADE - LOW_DECADE) * PER_DECADE + 1)
)
ZERO_BIN = 0
NONFINITE_BIN = len(BIN_EDGES) + 2
N_BINS = NONFINITE_BIN + 1


def _edge_label(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def bin_labels() -> tuple[str, ...]:
    """Each bin's short name: its lower edge (``0``, ``<1e-8``, ``1e-8``, ``3e-8``, ...,
    ``>=1e3``, ``nan``)."""
    inner = [_edge_label(e) for e in BIN_EDGES[:-1]]
    return ("0", f"<{_edge_label(BIN_EDGES[0])}", *inner, f">={_edge_label(BIN_EDGES[-1])}", "nan")


def read_counts(value: Any) -> tuple[int, ...] | None:
    """A list of N_BINS whole counts (>= 0); None for anything else (not measured)."""
    items = as_list(value)
    if len(items) != N_BINS:
        return None
    # What the probe sends: plain ints, checked here in one pass (as_int per bin was most of
    # a 100-layer message's decoding on the viewer's UI thread).
    if all(type(v) is int and v >= 0 for v in items):
        return tuple(items)
    counts = [as_int(v) for v in items]
    if any(c is None or c < 0 for c in counts):
        return None
    return tuple(c for c in counts if c is not None)


@dataclass(frozen=True)
class LayerHistogram:
    """One layer's counts per bin (None: not measured, e.g. no gradient this step, or a sparse
    one), and each kind's largest magnitude over the whole layer (exact even when the counts
    were sampled; NaN when the layer holds a NaN). ``stride``: 1 when every element was
    counted, k when one element in k was (a large layer, its cost bounded)."""

    layer: int
    weights: tuple[int, ...] | None
    grads: tuple[int, ...] | None
    weight_max: float = math.nan
    grad_max: float = math.nan
    stride: int = 1


@dataclass(frozen=True)
class Histograms:
    """The histograms measured at ``step`` for some layers (indices in the ``layers``
    message's order): not every layer every time, large models take turns."""

    step: int
    layers: tuple[LayerHistogram, ...]
    history: bool = False

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "histograms",
            "step": self.step,
            "layers": [h.layer for h in self.layers],
            "weights": [None if h.weights is None else list(h.weights) for h in self.layers],
            "grads": [None if h.grads is None else list(h.grads) for h in self.layers],
            "weight_max": [h.weight_max for h in self.layers],
            "grad_max": [h.grad_max for h in self.layers],
            "stride": [h.stride for h in self.layers],
        }
        if self.history:
            message["history"] = True
        return message

    @classmethod
    def from_wire(cls, message: Any) -> Histograms | None:
        """What is well formed of a ``histograms`` message (a layer with a bad index dropped, a
        bad list of counts read as not measured); None without a step."""
        if not isinstance(message, dict):
            return None
        step = as_int(message.get("step"))
        if step is None or step < 0:
            return None
        indices = as_list(message.get("layers"))
        n = len(indices)

        def column(key: str) -> list[Any]:
            values = as_list(message.get(key))[:n]
            return values + [None] * (n - len(values))

        weights, grads = column("weights"), column("grads")
        weight_max, grad_max, strides = column("weight_max"), column("grad_max"), column("stride")
        layers: list[LayerHistogram] = []
        for k, index in enumerate(indices):
            layer = as_int(index)
            if layer is None or layer < 0:
                continue
            stride = as_int(strides[k])
            wmax, gmax = as_float(weight_max[k]), as_float(grad_max[k])
            layers.append(
                LayerHistogram(
                    layer,
                    read_counts(weights[k]),
                    read_counts(grads[k]),
                    math.nan if wmax is None else wmax,
                    math.nan if gmax is None else gmax,
                    stride if stride is not None and stride >= 1 else 1,
                )
            )
        return cls(step, tuple(layers), message.get("history") is True)
