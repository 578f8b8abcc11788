"""Per-layer weight and gradient magnitude histograms on sampled steps, counted on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import perf_counter

import torch

from tdbg.probe.device_copy import device_tensor
from tdbg.probe.training.gradients import GradientStats
from tdbg.protocol.messages.histograms import (
    LOW_DECADE,
    N_BINS,
    NONFINITE_BIN,
    PER_DECADE,
)

# The most elements one layer's histogram counts (weights, and gradients alike): a larger
# layer is counted with a fixed stride (one element in k, said in the data), enough for its
# shape at the bins' resolution; its largest magnitude (and so whether it holds a NaN or Inf)
# is still read whole. Counting costs ~10 ns an element on a CPU (several passes), where a
# gradient pass reads one in ~0.3 ns: the bound keeps them on most sampled steps.
LAYER_ELEMENTS = 1 << 12
# The most elements one sampled step counts (weights and gradients): past it the layers take
# turns, a contiguous run per step, starting where the last one stopped.
PASS_ELEMENTS = 1 << 18
# What the histograms may cost, on average, as a share of the gradient passes' cost (the
# update ratios take another quarter): on a large model they run on fewer sampled steps.
HISTOGRAM_SHARE = 0.25

# A magnitude's bin from its log10: floor(PER_DECADE * log10|x|) + LOG_OFFSET is 2 at the first
# edge (1e-8), one more per half decade; clamped to the bins between "below" and "above".
LOG_OFFSET = 2 - LOW_DECADE * PER_DECADE
LAST_FINITE = NONFINITE_BIN - 1


def bin_codes(magnitudes: torch.Tensor) -> torch.Tensor:
    """Each magnitude's bin (int64, same shape): 0 for exact zeros, 1 below the first edge,
    one per half decade, then >= the last edge, and NONFINITE_BIN for NaN and Inf. From the
    log10 (five times faster than a search of the edges on a CPU: ~5 ms for 1M elements): an
    element within a rounding error of an edge may fall on either side of it."""
    if magnitudes.dtype in (torch.float16, torch.bfloat16):
        magnitudes = magnitudes.float()  # a float16 cannot hold 1e-8
    codes = (
        torch.log10(magnitudes).mul_(PER_DECADE).floor_().add_(LOG_OFFSET).clamp_(1, LAST_FINITE)
    )
    codes = torch.where(magnitudes == 0, 0.0, codes)
    # x - x is 0 for a finite x, NaN for NaN and Inf.
    return torch.where(magnitudes - magnitudes == 0, codes, float(NONFINITE_BIN)).long()


def bin_counts(x: torch.Tensor) -> torch.Tensor:
    """The histogram of one dense tensor's magnitudes: N_BINS float counts on its device, no
    sync (index_add_, where bincount would read the largest code)."""
    codes = bin_codes(x.detach().reshape(-1).abs())
    counts = torch.zeros(N_BINS, dtype=torch.float32, device=x.device)
    return counts.index_add_(0, codes, torch.ones(1, device=x.device).expand(codes.numel()))


@dataclass
class HistogramPart:
    """One optimizer's histograms of a step, on the device until the step's copy: ``values`` is
    ``[counts: rows x N_BINS] + [each tensor's max magnitude]``, rows being (layer, weights)
    and (layer, gradients) in turn; ``max_rows`` names each max's row; ``grads_read``: which
    layers had gradients counted."""

    layers: list[int]
    strides: list[int]
    grads_read: list[bool]
    max_rows: list[int]
    values: torch.Tensor

    @staticmethod
    def join(parts: list[HistogramPart]) -> HistogramPart:
        """Several optimizers' parts as one (rows renumbered after the first's)."""
        if len(parts) == 1:
            return parts[0]
        layers: list[int] = []
        strides: list[int] = []
        grads_read: list[bool] = []
        counts: list[torch.Tensor] = []
        maxes: list[torch.Tensor] = []
        max_rows: list[int] = []
        device = parts[0].values.device
        for part in parts:
            rows = 2 * len(layers)
            n = 2 * len(part.layers) * N_BINS
            values = part.values.to(device)
            counts.append(values[:n])
            maxes.append(values[n:])
            max_rows.extend(r + rows for r in part.max_rows)
            layers.extend(part.layers)
            strides.extend(part.strides)
            grads_read.extend(part.grads_read)
        return HistogramPart(layers, strides, grads_read, max_rows, torch.cat(counts + maxes))

    def read(
        self, host: list[float]
    ) -> list[tuple[int, list[int], list[int] | None, float, float, int]]:
        """Per layer (layer, weight counts, gradient counts or None, weight max, gradient max,
        stride), from ``values`` as read on the host."""
        rows = 2 * len(self.layers)
        counts = [int(round(c)) for c in host[: rows * N_BINS]]
        top = [-math.inf] * rows
        for row, value in zip(self.max_rows, host[rows * N_BINS :], strict=True):
            if math.isnan(value) or math.isnan(top[row]):
                top[row] = math.nan
            elif value > top[row]:
                top[row] = value
        out = []
        for k, layer in enumerate(self.layers):
            w = counts[2 * k * N_BINS : (2 * k + 1) * N_BINS]
            g = counts[(2 * k + 1) * N_BINS : (2 * k + 2) * N_BINS] if self.grads_read[k] else None
            wmax, gmax = top[2 * k], top[2 * k + 1] if self.grads_read[k] else math.nan
            out.append(
                (layer, w, g, wmax if wmax != -math.inf else math.nan, gmax, self.strides[k])
            )
        return out


class LayerHistograms:
    """One optimizer's layers' weight and gradient histograms: :meth:`compute` right after its
    gradient pass, before the update (the gradients it uses, the weights its forward used).
    A handful of fused kernels over every tensor of the turn, no sync; the counts stay on the
    device until the step's one copy. Never per step: only on steps whose gradients are
    sampled, and then only while their credit lasts (:meth:`due`)."""

    def __init__(self, stats: GradientStats, pass_elements: int | None = None) -> None:
        by_layer: dict[int, list[torch.Tensor]] = {}
        for param, layer in zip(stats.params, stats.param_layer, strict=True):
            # Integer parameters cannot require grad, so none are here; complex ones are
            # counted by their modulus.
            by_layer.setdefault(layer, []).append(param)
        self._layers: list[tuple[int, list[torch.Tensor], int]] = []
        for layer, params in sorted(by_layer.items()):
            numel = sum(p.numel() for p in params)
            self._layers.append((layer, params, max(1, math.ceil(numel / LAYER_ELEMENTS))))
        # Elements counted per layer (weights and gradients): what a turn adds up.
        self._sizes = [2 * sum(_counted(p.numel(), s) for p in ps) for _, ps, s in self._layers]
        self._pass_elements = PASS_ELEMENTS if pass_elements is None else pass_elements
        self._next = 0
        self._credit = 0.0
        self._cost = 0.0
        self._counted = 0  # passes made: the first (cold: allocations, first calls) is free
        self.sparse_seen = False  # a sparse gradient was left out (the caller says so once)

    def due(self, pass_seconds: float) -> bool:
        """Whether this sampled step counts histograms: they may cost HISTOGRAM_SHARE of what
        the gradient passes cost, on average; the first two times, always (the first one's
        cost, cold, is not what the next ones cost: it is not counted)."""
        self._credit = min(self._credit + HISTOGRAM_SHARE * pass_seconds, 4 * self._cost + 1e-3)
        return self._counted < 2 or self._credit >= self._cost

    def spent(self, seconds: float) -> None:
        self._counted += 1
        if self._counted == 1:
            return
        self._credit -= seconds
        self._cost = seconds if self._cost == 0.0 else 0.8 * self._cost + 0.2 * seconds

    def _turn(self) -> list[tuple[int, list[torch.Tensor], int]]:
        chosen: list[tuple[int, list[torch.Tensor], int]] = []
        used = 0
        k = self._next
        for _ in range(len(self._layers)):
            if chosen and used + self._sizes[k] > self._pass_elements:
                break
            chosen.append(self._layers[k])
            used += self._sizes[k]
            k = (k + 1) % len(self._layers)
        self._next = k
        return chosen

    # Eager even where dynamo traces the optimizer's step: a few kernels on sampled steps.
    @torch.compiler.disable
    def compute(self) -> tuple[HistogramPart | None, float]:
        """This turn's layers' histograms (None when there is nothing to count) and the seconds
        it took (paid from the credit; the caller counts them as the probe's)."""
        started = perf_counter()
        if not self._layers:
            return None, 0.0
        chosen = self._turn()
        whole: list[torch.Tensor] = []  # what is counted, whole: weights, gradients, per layer
        counted: list[torch.Tensor] = []  # the same, one element in the layer's stride
        rows: list[int] = []  # each one's row: (layer, weights), (layer, gradients) in turn
        grads_read: list[bool] = []
        for k, (_, params, stride) in enumerate(chosen):
            read = False
            for p in params:
                if p.numel() == 0:  # nothing to count, and no max to read
                    continue
                w = p.detach()
                whole.append(w)
                counted.append(_strided(w, stride))
                rows.append(2 * k)
                g = p.grad
                if g is None:
                    continue
                if g.layout != torch.strided:
                    self.sparse_seen = True
                    continue
                read = True
                whole.append(g)
                counted.append(_strided(g, stride))
                rows.append(2 * k + 1)
            grads_read.append(read)
        if not whole:
            return None, 0.0
        device = whole[0].device
        with torch.no_grad():
            flat = torch.cat([t if t.device == device else t.to(device) for t in counted])
            magnitudes = flat.abs() if flat.is_complex() else flat.abs_()
            counts = _row_counts(magnitudes, counted, rows, 2 * len(chosen))
            maxes = _largest(whole, device)
            values = torch.cat([counts, maxes])
        layers = [layer for layer, _, _ in chosen]
        strides = [stride for _, _, stride in chosen]
        part = HistogramPart(layers, strides, grads_read, rows, values)
        took = perf_counter() - started
        self.spent(took)
        return part, took


def _row_counts(
    magnitudes: torch.Tensor, parts: list[torch.Tensor], rows: list[int], n_rows: int
) -> torch.Tensor:
    """``n_rows`` histograms (flat, float32, on the device) of ``magnitudes``: the tensors of
    ``parts`` concatenated, tensor k's elements counted in row ``rows[k]``."""
    device = magnitudes.device
    # Each element's row, as an offset into the flat counts.
    offsets = torch.repeat_interleave(
        device_tensor([row * N_BINS for row in rows], device),
        device_tensor([t.numel() for t in parts], device),
        output_size=magnitudes.numel(),
    )
    codes = bin_codes(magnitudes).add_(offsets)
    counts = torch.zeros(n_rows * N_BINS, dtype=torch.float32, device=device)
    return counts.index_add_(0, codes, torch.ones(1, device=device).expand(codes.numel()))


def sample_stride(numel: int) -> int:
    """The stride a tensor of ``numel`` elements is counted with: 1 up to LAYER_ELEMENTS, else
    the next odd one that keeps it under (odd: a row of a power-of-two width is visited in
    every column, where an even stride would keep to some of them)."""
    stride = max(1, math.ceil(numel / LAYER_ELEMENTS))
    return stride if stride == 1 or stride % 2 else stride + 1


@torch.compiler.disable
def counts_per_tensor(samples: list[torch.Tensor]) -> torch.Tensor:
    """One histogram per tensor (float, dense, on one device), rows x N_BINS float32 counts on
    the first one's device: one concatenation and one counting pass for all of them, no sync.
    What the activation-statistics dive counts its modules' outputs with."""
    device = samples[0].device
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).to(device) for t in samples])
        counts = _row_counts(flat.abs_(), samples, list(range(len(samples))), len(samples))
    return counts.view(len(samples), N_BINS)


def _largest(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's largest magnitude, read whole (exact; NaN where it holds a NaN), float32
    on ``device``: one fused kernel on a GPU; on a CPU, where the infinity norm is ~25x slower
    than a plain reduction, its lowest and highest values."""
    if device.type != "cpu":
        norms = torch._foreach_norm(tensors, math.inf)
        return torch.stack([n.float().to(device) for n in norms])
    lows: list[torch.Tensor] = []
    highs: list[torch.Tensor] = []
    for t in tensors:
        if t.is_complex():
            high = torch.linalg.vector_norm(t, math.inf)
            lows.append(high)
            highs.append(high)
            continue
        low, high = torch.aminmax(t)
        lows.append(low if low.dtype == torch.float32 else low.float())
        highs.append(high if high.dtype == torch.float32 else high.float())
    return torch.maximum(torch.stack(lows).abs_(), torch.stack(highs).abs_())


def _counted(numel: int, stride: int) -> int:
    return (numel + stride - 1) // stride


def _strided(x: torch.Tensor, stride: int) -> torch.Tensor:
    """Every ``stride``-th element of ``x`` (a view where it is contiguous)."""
    flat = x.reshape(-1)
    return flat if stride == 1 else flat[::stride]
