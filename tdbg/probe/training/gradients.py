"""Per-layer gradient norms with fused foreach ops, left on the device until the step's one copy."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from tdbg.probe.module_paths import user_paths

LOW_PRECISION = (torch.float16, torch.bfloat16)
_VERSION = attrgetter("_version")  # a tensor's in-place modification counter


@dataclass(frozen=True)
class Layer:
    """A module that owns parameters directly, named as in ``named_modules()``."""

    name: str
    params: tuple[nn.Parameter, ...]
    module_type: str = ""  # the class name of the module that owns them

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def trainable(self) -> bool:
        """False for a frozen layer: its zero norm is expected, not an alert."""
        return any(p.requires_grad for p in self.params)


def find_layers(
    model: nn.Module, name: str | None = None, prefix: str = "", seen: set[int] | None = None
) -> list[Layer]:
    """Layers in ``named_modules()`` order; a parameter shared by two modules counts once.

    The root module's own parameters form a layer named ``name`` (the model's name; its class
    name when it has none); the others are named ``prefix`` + their ``named_modules()`` path,
    without the segments torch's wrappers add (``torch.compile``'s ``_orig_mod``, DDP's
    ``module``): :func:`~tdbg.probe.module_paths.user_paths`.
    ``seen``: parameter ids already taken (by another watched model)."""
    seen = set() if seen is None else seen
    layers: list[Layer] = []
    for path, module in user_paths(model):
        own = []
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                own.append(param)
        if own:
            label = prefix + path if path else (name or type(model).__name__)
            layers.append(Layer(label, tuple(own), type(module).__name__))
    return layers


@dataclass
class GradSample:
    """One sampled step's gradient norms, per parameter, as the fused kernel left them.

    ``values[i]`` is the norm of a parameter of layer ``layer_index[i]``; the probe thread folds
    them into per-layer norms (:func:`layer_norms`) — after the step's one device-to-host copy on
    a GPU — so the training thread pays only for the fused norm kernel (and a stack on a GPU).
    With ``weights``, ``values`` continues with the same parameters' weight norms, in the same
    order: where a NaN began, on no extra copy (:meth:`weight_nonfinite`). They are read only
    where they can matter (a step found non-finite, a GPU run): see :class:`GradientStats`.
    """

    values: torch.Tensor | Sequence[torch.Tensor]  # 0-d tensors, one per parameter, on the CPU
    layer_index: torch.Tensor  # on the host, int64, one entry per gradient norm
    n_layers: int
    missing: list[int]  # layers with a parameter that requires grad but has no .grad
    weights: bool = False  # values = [gradient norms] + [weight norms]
    # Layers with no parameters at all: they left the model (the probe keeps their index). No
    # norm, so NaN rather than a 0 that looks real; a row read before they left has theirs.
    gone: tuple[int, ...] = ()

    @property
    def on_host(self) -> bool:
        return not isinstance(self.values, torch.Tensor)

    @staticmethod
    def join(samples: Sequence[GradSample]) -> GradSample:
        """One sample from several optimizers' (disjoint parameters, the same layers)."""
        if len(samples) == 1:
            return samples[0]
        weights = all(s.weights for s in samples)
        grads: list[torch.Tensor] = []
        norms_of_weights: list[torch.Tensor] = []
        for s in samples:
            n = len(s.layer_index)
            if not n:
                continue
            vector = s.values if isinstance(s.values, torch.Tensor) else torch.stack(list(s.values))
            grads.append(vector[:n])
            if weights:
                norms_of_weights.append(vector[n : 2 * n])
        parts = grads + norms_of_weights
        if parts:
            device = parts[0].device
            values = torch.cat([p.float().to(device, non_blocking=True) for p in parts])
        else:
            values = torch.zeros(0)
        index = torch.cat([s.layer_index for s in samples])
        missing = sorted({i for s in samples for i in s.missing})
        # Gone in every pass's layers: one read before the change still had its norm.
        gone = tuple(sorted(set.intersection(*(set(s.gone) for s in samples))))
        # On the step the layers changed, one optimizer's pass may have been read with the
        # layers as they were (fewer): the row is as wide as the widest.
        n_layers = max(s.n_layers for s in samples)
        return GradSample(values, index, n_layers, missing, weights, gone)

    def host_nonfinite(self) -> bool:
        """The norms are on the host (a CPU run) and one is NaN or Inf: known with no sync, so
        the training thread can act on it before the update (read the weights, re-run the
        forward). False for a device pass: that would need a sync."""
        values = self.values
        # A device pass's one stacked tensor first: its truth value would be ambiguous.
        if isinstance(values, torch.Tensor) or not values:
            return False
        # One float read a norm, in C (map): a stack and a sum cost twice as much right after
        # a backward, when every small op is slow. It stops at the first NaN or Inf.
        return not all(map(math.isfinite, map(torch.Tensor.item, values)))

    def _vector(self, host_values: torch.Tensor | None) -> torch.Tensor:
        values = self.values if host_values is None else host_values
        if not isinstance(values, torch.Tensor):
            values = torch.stack([v.float() for v in values]) if values else torch.zeros(0)
        return values

    def weight_nonfinite(self, host_values: torch.Tensor | None = None) -> list[int]:
        """Layers whose weights held a NaN or Inf when the gradients were read (the weights
        this step's forward used); [] when weights were not measured."""
        if not self.weights:
            return []
        n = len(self.layer_index)
        weights = self._vector(host_values)[n : 2 * n].detach().to("cpu", torch.float64)
        bad = ~torch.isfinite(weights)
        if not bool(bad.any()):
            return []
        return sorted({int(i) for i in self.layer_index[bad].tolist()})

    def layer_norms(self, host_values: torch.Tensor | None = None) -> tuple[array, float]:
        values = self._vector(host_values)[: len(self.layer_index)]
        return layer_norms(values, self.layer_index, self.n_layers, self.gone)


def layer_norms(
    values: torch.Tensor, layer_index: torch.Tensor, n_layers: int, gone: Sequence[int] = ()
) -> tuple[array, float]:
    """(per-layer L2 norms as float32, the total norm) from per-parameter norms (host tensors);
    NaN for the ``gone`` layers (no parameters: no norm).

    The norms go from the tensor to one float32 array — the wire's own layout — with no Python
    float per layer on the way: a 1,000-layer model costs the probe thread one buffer copy.
    """
    squares = values.detach().to("cpu", torch.float64).square()
    per_layer = torch.zeros(n_layers, dtype=torch.float64).index_add_(0, layer_index, squares)
    total = float(per_layer.sum().sqrt())  # float64, as the squares were summed
    if gone:
        per_layer[list(gone)] = math.nan
    norms = array("f")
    norms.frombytes(per_layer.sqrt_().to(torch.float32).numpy().tobytes())
    return norms, total


class _no_grad:
    """``torch.no_grad()`` for the gradient pass: the same switch, a tenth of its cost (the
    context manager costs tens of microseconds right after a backward; the pass is ~100)."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = torch.is_grad_enabled()
        if self.enabled:
            torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            torch._C._set_grad_enabled(True)


class GradientStats:
    """Computes per-parameter gradient norms for a fixed list of layers.

    Cost per call on the training thread: per (device, dtype) group one fused ``_foreach_norm``
    kernel; on a GPU also one stack (plus a cast and a cat when there are several groups) so the
    step has a single tensor to copy; no ``.item()``, no host sync. The Python work is one pass
    over the parameters to collect their ``.grad`` (a foreach op needs the list anyway).
    Per-layer sums happen later, in the probe thread.

    The weights' norms (where a NaN began) double the bytes read, so they are not read on an
    ordinary step: ``compute(weights=True)`` reads them in the same fused call, and
    :meth:`with_weights` adds them to a pass already made, for a step found non-finite.
    """

    def __init__(self, layers: list[Layer], only: set[int] | None = None) -> None:
        """``only``: ids of the parameters to cover (one optimizer's); None: every trainable one.
        Layer indices stay those of ``layers``, so several of these fill one per-layer row."""
        self.layers = layers
        self.n_layers = len(layers)
        self._params: list[nn.Parameter] = []
        self._param_layer: list[int] = []
        for index, layer in enumerate(layers):
            for param in layer.params:
                if param.requires_grad and (only is None or id(param) in only):
                    self._params.append(param)
                    self._param_layer.append(index)
        self._weights: list[torch.Tensor] = list(self._params)
        self.layer_indices = sorted(set(self._param_layer))
        self._gone = tuple(i for i, layer in enumerate(layers) if not layer.params)
        self.param_ids = frozenset(id(p) for p in self._params)
        self.params: list[nn.Parameter] = self._params  # what it covers, and each one's layer
        self.param_layer: list[int] = self._param_layer

        self._plan_key: tuple[type, ...] | None = None
        self._whole = False
        self._plain = False  # _whole, on the host, dense, full precision: the fast pass
        self._plan: list[tuple[list[int], bool, bool]] = []  # (members, sparse, low precision)
        self._on_host = True
        self._layer_index = torch.zeros(0, dtype=torch.int64)
        self._missing: list[int] = []
        self._device: torch.device | None = None
        self.replanned = False  # the last compute() built a new plan (its time is not typical)
        # The parameters' in-place modification counters at the last two passes that noted
        # them (note_versions): what tells a weight changed by the optimizer from one changed
        # by other code (changed_layers).
        self.versions: list[int] | None = None
        self.previous_versions: list[int] | None = None

    @property
    def n_params(self) -> int:
        return len(self._params)

    @property
    def device(self) -> torch.device:
        if self._device is None:
            self._device = self._params[0].device if self._params else torch.device("cpu")
        return self._device

    def note_versions(self) -> None:
        """Remember every parameter's modification counter (one attribute read a parameter)."""
        self.previous_versions, self.versions = self.versions, list(map(_VERSION, self._params))

    def changed_layers(self) -> list[int] | None:
        """Layers with a parameter modified in place more often than most parameters between
        the last two :meth:`note_versions`: changed by code other than the optimizer's update
        (which bumps every parameter it updates alike); None when there is nothing to compare.

        torch's optimizers (SGD, Adam, ... foreach or not) bump each updated parameter by the
        same count per step, and a fused one by none; an assignment under ``no_grad``
        (``w[0] = nan``), ``clamp_``, ``renorm_`` add one more to the parameters they touch. A
        parameter that missed updates (no gradient) counts fewer, which never names it."""
        before, now = self.previous_versions, self.versions
        if before is None or now is None or len(before) != len(now) or not now:
            return None
        deltas = [b - a for a, b in zip(before, now, strict=True)]
        usual = Counter(deltas).most_common(1)[0][0]
        return sorted({self._param_layer[i] for i, d in enumerate(deltas) if d > usual})

    def _make_plan(self, grads: list[torch.Tensor | None], key: tuple[type, ...]) -> None:
        """Group present grads by (device, dtype, layout); remember each norm's layer."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, grad in enumerate(grads):
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype, grad.layout), []).append(i)
        # Everything a pass would ask of a tensor is decided here, once: right after backward a
        # single cold `device.type` or `dtype` lookup costs microseconds, on the training thread.
        self._plan = [
            (members, layout == torch.sparse_coo, dtype in LOW_PRECISION)
            for (_device, dtype, layout), members in groups.items()
        ]
        self._on_host = self.device.type == "cpu"
        order = [self._param_layer[i] for members, _, _ in self._plan for i in members]
        self._layer_index = torch.tensor(order, dtype=torch.int64)
        self._missing = sorted({self._param_layer[i] for i, g in enumerate(grads) if g is None})
        # The usual case: one group holding every parameter in order needs no regrouping.
        self._whole = len(self._plan) == 1 and self._plan[0][0] == list(range(len(grads)))
        self._plain = self._whole and self._on_host and not any(self._plan[0][1:])
        self._plan_key = key

    def compute(self, weights: bool = False) -> GradSample:
        """This step's gradient norms; with ``weights`` also the weights' norms, in the same
        fused call (a step already known to be non-finite, or a GPU run: see the sampler)."""
        grads = [p.grad for p in self._params]
        # Which grads exist, as a C-level map: a Python-level generator costs ~1 µs a parameter.
        key = tuple(map(type, grads))
        self.replanned = key != self._plan_key
        if self.replanned:
            self._make_plan(grads, key)
        if self._plain and not weights:
            # The usual CPU pass: one dense full-precision group, gradients only — the fused
            # call and nothing else. No grad-mode switch: a gradient does not require grad
            # (short of create_graph=True, where the norms' small graph is dropped with them).
            fused = torch._foreach_norm(grads)  # type: ignore[arg-type]
            return GradSample(
                fused, self._layer_index, self.n_layers, self._missing, False, self._gone
            )
        norms: list[tuple[torch.Tensor, ...]] = []
        weight_norms: list[tuple[torch.Tensor, ...]] = []
        with _no_grad():  # a pre-step hook may run with grad mode on: no graph of weights
            for members, sparse, low_precision in self._plan:
                group = grads if self._whole else [grads[i] for i in members]
                kwargs = {"dtype": torch.float32} if low_precision else {}
                # Low precision accumulates in float32: an fp16 norm overflows at 65504.
                if sparse:
                    dense = [g.coalesce().values() for g in group]  # type: ignore[union-attr]
                    norms.append(torch._foreach_norm(dense, 2, **kwargs))
                    if weights:
                        weight_norms.append(torch._foreach_norm(self._group(members), 2, **kwargs))
                elif weights:
                    # One fused call over the gradients and their weights: one kernel launch.
                    both = torch._foreach_norm([*group, *self._group(members)], 2, **kwargs)  # type: ignore[list-item]
                    norms.append(both[: len(group)])
                    weight_norms.append(both[len(group) :])
                else:
                    norms.append(torch._foreach_norm(group, 2, **kwargs))  # type: ignore[arg-type]
        return self._sample(norms, weight_norms)

    def with_weights(self, sample: GradSample) -> GradSample:
        """``sample`` (this step's gradient pass, weights not read) and the weights' norms now,
        in the same order: read only on a step found non-finite, where a NaN may have begun.
        One more fused call over the weights; the gradient norms are reused as they are."""
        if sample.weights or not len(sample.layer_index):
            return sample
        weight_norms: list[tuple[torch.Tensor, ...]] = []
        with _no_grad():
            for members, _sparse, low_precision in self._plan:
                kwargs = {"dtype": torch.float32} if low_precision else {}
                weight_norms.append(torch._foreach_norm(self._group(members), 2, **kwargs))
        ordered = [n for group in weight_norms for n in group]
        values: torch.Tensor | Sequence[torch.Tensor]
        if isinstance(sample.values, torch.Tensor):
            device = sample.values.device
            extra = torch.stack([n.float().to(device, non_blocking=True) for n in ordered])
            values = torch.cat([sample.values.float(), extra])
        else:
            values = [*sample.values, *ordered]
        return GradSample(
            values, sample.layer_index, sample.n_layers, sample.missing, True, sample.gone
        )

    def _group(self, members: list[int]) -> list[torch.Tensor]:
        return self._weights if self._whole else [self._weights[i] for i in members]

    def _sample(
        self, norms: list[tuple[torch.Tensor, ...]], weight_norms: list[tuple[torch.Tensor, ...]]
    ) -> GradSample:
        values: torch.Tensor | Sequence[torch.Tensor]
        if self._on_host and len(norms) == 1 and not weight_norms:
            values = norms[0]  # the usual CPU pass: the kernel's own tuple, as it is
            return GradSample(
                values, self._layer_index, self.n_layers, self._missing, False, self._gone
            )
        ordered = [n for group in (*norms, *weight_norms) for n in group]
        if not norms:
            values = []  # no parameter has a gradient: nothing to copy
        elif self._on_host:
            # Already on the host: the probe thread stacks them, not the training thread.
            values = ordered
        elif len(norms) == 1:
            values = torch.stack(ordered)  # one tensor: the step's single copy needs it
        else:
            values = torch.cat(
                [torch.stack(n).to(self.device, non_blocking=True) for n in (*norms, *weight_norms)]
            )
        weights = bool(norms) and bool(weight_norms)
        return GradSample(
            values, self._layer_index, self.n_layers, self._missing, weights, self._gone
        )
