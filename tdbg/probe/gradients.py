"""Per-layer gradient norms with fused foreach ops, left on the device until the step's one copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Layer:
    """A module that owns parameters directly, named as in ``named_modules()``."""

    name: str
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def find_layers(model: nn.Module) -> list[Layer]:
    """Layers in ``named_modules()`` order; a parameter shared by two modules counts once."""
    seen: set[int] = set()
    layers: list[Layer] = []
    for name, module in model.named_modules(remove_duplicate=True):
        own = []
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                own.append(param)
        if own:
            layers.append(Layer(name or type(model).__name__, tuple(own)))
    return layers


@dataclass
class GradSample:
    """Device tensors of one sampled step; ``values`` is [total, layer_0, ..., layer_n-1]."""

    values: torch.Tensor
    missing: list[int]  # layers with a parameter that requires grad but has no .grad


class GradientStats:
    """Computes per-layer and total gradient norms for a fixed list of layers.

    Cost per call: per (device, dtype) group one fused ``_foreach_norm`` kernel, one stack and one
    ``index_add_`` into the per-layer buckets; no ``.item()``, no host sync. The Python work is one
    pass over the parameters to collect their ``.grad`` (a foreach op needs the list anyway).
    """

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.n_layers = len(layers)
        self._params: list[nn.Parameter] = []
        self._param_layer: list[int] = []
        for index, layer in enumerate(layers):
            for param in layer.params:
                if param.requires_grad:
                    self._params.append(param)
                    self._param_layer.append(index)
        self._plan_key: bytes | None = None
        self._plan: list[tuple[list[int], torch.Tensor]] = []
        self._device: torch.device | None = None
        self.replanned = False  # the last compute() built a new plan (its time is not typical)

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = self._params[0].device if self._params else torch.device("cpu")
        return self._device

    def _make_plan(self, grads: list[torch.Tensor | None]) -> list[tuple[list[int], torch.Tensor]]:
        """Group present grads by (device, dtype); each group gets its layer index tensor."""
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, grad in enumerate(grads):
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype), []).append(i)
        plan = []
        for members in groups.values():
            index = torch.tensor([self._param_layer[i] for i in members], device=self.device)
            plan.append((members, index))
        return plan

    def compute(self) -> GradSample:
        grads = [p.grad for p in self._params]
        key = bytes(g is not None for g in grads)
        self.replanned = key != self._plan_key
        if self.replanned:
            self._plan = self._make_plan(grads)
            self._plan_key = key
        layer_sq = torch.zeros(self.n_layers, dtype=torch.float32, device=self.device)
        for members, index in self._plan:
            group = [grads[i] for i in members]
            if group[0].is_sparse:  # type: ignore[union-attr]
                group = [g.coalesce().values() for g in group]  # type: ignore[union-attr]
            norms = torch.stack(torch._foreach_norm(group))  # type: ignore[arg-type]
            norms = norms.to(device=self.device, dtype=torch.float32, non_blocking=True)
            layer_sq.index_add_(0, index, norms * norms)
        total = layer_sq.sum().sqrt().reshape(1)
        values = torch.cat((total, layer_sq.sqrt()))
        missing: list[int] = []
        if 0 in key:
            missing = sorted({self._param_layer[i] for i, present in enumerate(key) if not present})
        return GradSample(values, missing)


def reference_norms(layers: list[Layer]) -> tuple[float, list[float]]:
    """The slow, obvious computation the fused one must equal: ``p.grad.norm()`` per parameter."""
    per_layer = []
    for layer in layers:
        sq = 0.0
        for p in layer.params:
            if p.grad is not None:
                sq += float(p.grad.detach().double().norm()) ** 2
        per_layer.append(sq**0.5)
    return sum(v * v for v in per_layer) ** 0.5, per_layer
