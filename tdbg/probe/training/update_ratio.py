"""Each layer's update ratio ‖Δw‖/‖w‖ on sampled steps: its weights copied before the update,
compared after it — exact for the update applied, whatever the optimizer did (momentum, Adam,
weight decay, fused or foreach kernels, several optimizers)."""

from __future__ import annotations

from time import perf_counter

import torch

from tdbg.probe.device_copy import device_tensor
from tdbg.probe.training.gradients import GradientStats

# The most weight bytes copied on one sampled step (a transient copy, freed at the update's
# end). A model larger than this has its layers measured in turns, a contiguous run of layers
# per sampled step, starting where the last one stopped; a layer larger than it alone is not
# measured (reading its update would need a copy that large).
COPY_BYTES = 16 << 20
# What the ratios may cost, on average, as a share of the gradient passes' cost: a measurement
# reads the weights about five times (the copy, the difference, the norm), a pass reads the
# gradients once, so on a model whose copy is large they are measured on fewer sampled steps.
RATIO_SHARE = 0.25


class UpdateRatios:
    """One optimizer's layers' update ratios: :meth:`begin` before its update (the weights
    copied, on their devices: no sync), :meth:`finish` after it (one subtraction and two fused
    norms; the ratios stay on the device until the step's one copy). Never per step: only on
    steps whose gradients are sampled."""

    def __init__(self, stats: GradientStats, copy_bytes: int = COPY_BYTES) -> None:
        # The layers this optimizer updates, each with its floating-point parameters.
        by_layer: dict[int, list[torch.Tensor]] = {}
        for param, layer in zip(stats.params, stats.param_layer, strict=True):
            if param.is_floating_point() and not param.is_sparse:
                by_layer.setdefault(layer, []).append(param)
        self._layers = [
            (layer, params)
            for layer, params in sorted(by_layer.items())
            if sum(p.numel() * p.element_size() for p in params) <= copy_bytes
        ]
        self._sizes = [sum(p.numel() * p.element_size() for p in ps) for _, ps in self._layers]
        self._copy_bytes = copy_bytes
        self._next = 0  # the first layer of the next turn
        # Between begin() and finish(): the layers measured, their parameters, the copies and
        # each parameter's layer position (for the per-layer sums).
        self._taken: tuple[list[int], list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None
        self._taken = None
        # Per first layer of a turn: its layers, their parameters, each one's position, and
        # the next turn's first layer (built once: a small model measures the same set always).
        self._plans: dict[int, tuple[list[int], list[torch.Tensor], torch.Tensor, int]] = {}
        self._credit = 0.0  # seconds of pass time the ratios may still spend (see due())
        self._cost = 0.0  # running average of a measurement's seconds (0: not measured yet)
        self._begun = 0.0  # the copy's seconds, until finish() adds the rest

    def due(self, pass_seconds: float) -> bool:
        """Whether this sampled step measures the ratios, given what its gradient pass just
        cost: the ratios may cost RATIO_SHARE of what the passes cost, on average (a
        copy of the weights is several passes' worth of memory traffic), so on a large model
        they are measured on one sampled step in several; the first time, always."""
        self._credit = min(self._credit + RATIO_SHARE * pass_seconds, 4 * self._cost + 1e-3)
        return self._cost == 0.0 or self._credit >= self._cost

    def spent(self, seconds: float) -> None:
        """What a measurement (its copy and its ratios) took: paid from the credit."""
        self._credit -= seconds
        self._cost = seconds if self._cost == 0.0 else 0.8 * self._cost + 0.2 * seconds

    # Eager even where dynamo traces the optimizer's step (``torch.compile(optimizer.step)``):
    # a copy and a few norms, on sampled steps only, are no part of the user's graph.
    @torch.compiler.disable
    def begin(self) -> float:
        """Copy the weights of this turn's layers (their update is about to happen); returns
        the seconds it took (the caller counts them as the probe's, as a pass is; a clock read
        here, never in the caller, which dynamo may be tracing)."""
        started = perf_counter()
        self._taken = None
        if not self._layers:
            return 0.0
        start = self._next
        plan = self._plans.get(start)
        if plan is None:
            chosen: list[int] = []
            params: list[torch.Tensor] = []
            owner: list[int] = []
            used = 0
            k = start
            for _ in range(len(self._layers)):
                size = self._sizes[k]
                if chosen and used + size > self._copy_bytes:
                    break
                layer, layer_params = self._layers[k]
                owner.extend([len(chosen)] * len(layer_params))
                chosen.append(layer)
                params.extend(layer_params)
                used += size
                k = (k + 1) % len(self._layers)
            where = device_tensor(owner, params[0].device)
            plan = self._plans[start] = (chosen, params, where, k)
        chosen, params, where, self._next = plan
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        self._taken = (chosen, params, before, where)
        self._begun = perf_counter() - started
        return self._begun

    @torch.compiler.disable
    def finish(self) -> tuple[tuple[list[int], torch.Tensor] | None, float]:
        """The layers measured and their ratios (float32, on the weights' device), once the
        update is done (None when no copy was taken: not a sampled step, or dropped), and the
        seconds it took."""
        taken, self._taken = self._taken, None
        if taken is None:
            return None, 0.0
        started = perf_counter()
        layers, params, before, where = taken
        with torch.no_grad():
            # ‖w_before - w_after‖ without writing the difference anywhere (one read of each),
            # and ‖w_before‖ from the copy.
            moved = torch.stack(
                [torch.dist(b, p.detach()).float() for b, p in zip(before, params, strict=True)]
            )
            sizes = torch.stack([n.float() for n in torch._foreach_norm(before)])
            device = where.device
            delta = torch.zeros(len(layers), device=device).index_add_(
                0, where, moved.to(device).square()
            )
            weight = torch.zeros(len(layers), device=device).index_add_(
                0, where, sizes.to(device).square()
            )
            # A zero or non-finite weight norm has no ratio (NaN), not an infinite one.
            ratios = delta.sqrt() / weight.sqrt()
            ratios = torch.where(weight > 0, ratios, torch.full_like(ratios, float("nan")))
        took = perf_counter() - started
        self.spent(self._begun + took)
        return (layers, ratios), took

    def drop(self) -> None:
        """Forget a copy whose update never came (a skipped step, an update that raised)."""
        self._taken = None
