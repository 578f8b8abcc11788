"""``watch(skip_nonfinite=True)``: skip an update with non-finite gradients, as GradScaler does.

Training thread. :class:`NonfiniteGuard` is called from the optimizer's step pre-hook, before the
update reads the gradients. Cost per step: per (device, dtype) group one fused
``torch._foreach_norm`` — on a GPU with ``ord=inf`` (the largest magnitude: finite exactly when
every element is, and it cannot overflow the way a 2-norm of large finite values can); on the
CPU, where the inf-norm kernel is some 15x slower than the 2-norm, the 2-norm accumulated in
float64 (finite for any float32 values; a float64 gradient takes the inf-norm there too) — a
stack and a sum on the device, and ONE host-device sync (``.item()``): the price of deciding
on the host whether the update may run. Only on a skipped step a second sync reads which
layers were non-finite.

Skipping: the ``.grad`` of every parameter the optimizer updates is set to None, the watched
model's and any other it holds (:func:`guard_of`). torch's optimizers (SGD with
momentum and weight decay, Adam, AdamW, and the others built on ``_init_group``) leave a
parameter whose grad is None untouched, its state included, so the update is a no-op.
(The lr scheduler still steps; GradScaler does the same.)

:func:`find_forward_origin` re-runs a forward under ``no_grad`` with hooks on every module to
name the module that first made a non-finite output from finite inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tdbg.probe.module_paths import user_paths

INF = float("inf")
# The layer a skip names for a parameter the optimizer updates outside the watched model (a
# learnable temperature beside it, a second model on the same optimizer).
UNWATCHED = -1


class NonfiniteGuard:
    """Checks the watched parameters' gradients with one sync; clears them all if non-finite.

    ``params``: the parameters the optimizer updates (:func:`guard_of`: all of them, the
    watched ones and any other). ``layer_index``: for each parameter, the index of its layer
    (the probe's layer order; UNWATCHED outside the watched model), so that a skip can say
    which layers were non-finite; by default each parameter is its own layer.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], layer_index: Sequence[int] | None = None
    ) -> None:
        self.params = list(params)
        if layer_index is not None and len(layer_index) != len(self.params):
            raise ValueError("layer_index needs one entry per parameter")
        self.layer_index = list(layer_index) if layer_index is not None else None
        self.skipped = 0  # updates skipped so far
        self.nonfinite_layers: list[int] = []  # after a skip: the layers with a non-finite grad

    def _layer(self, i: int) -> int:
        return self.layer_index[i] if self.layer_index is not None else i

    def check_and_skip(self) -> bool:
        """True if a gradient was non-finite: every watched ``.grad`` is then None (the update
        does nothing), :attr:`skipped` counts it and :attr:`nonfinite_layers` names the layers
        (sorted). False, and nothing touched, when all are finite or none is present."""
        self.nonfinite_layers = []
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce().values()
            groups.setdefault((g.device, g.dtype), []).append((i, g))
        if not groups:
            return False
        index: list[int] = []
        per_group: list[torch.Tensor] = []
        for entries in groups.values():
            grads = [g for _, g in entries]
            if grads[0].device.type == "cuda" or grads[0].element_size() > 4:
                # (A float64 gradient's 2-norm can overflow while every element is finite.)
                norms = torch._foreach_norm(grads, INF)
            else:
                norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
            index.extend(i for i, _ in entries)
            per_group.append(torch.stack(list(norms)).double())  # a 2-norm may pass float32's max
        first = per_group[0].device
        every = torch.cat([n.to(first, non_blocking=True) for n in per_group])
        # A sum of finite maxima in float64 stays finite; NaN and inf propagate. The one sync:
        if math.isfinite(every.double().sum().item()):
            return False
        flags = torch.isfinite(every).tolist()  # second sync, only on a skipped step
        self.nonfinite_layers = sorted(
            {self._layer(index[k]) for k, ok in enumerate(flags) if not ok}
        )
        for p in self.params:
            p.grad = None
        self.skipped += 1
        return True


def guard_of(
    optimizer: Any, params: Sequence[nn.Parameter], param_layer: Sequence[int]
) -> NonfiniteGuard:
    """A guard over every parameter ``optimizer`` updates: the watched ones (``params``, each
    in its layer ``param_layer``) and any other (UNWATCHED). A skip that cleared the model's
    gradients only would still let the update write a non-finite gradient into a parameter
    outside it, and from there into every later step's."""
    layer_of = {id(p): layer for p, layer in zip(params, param_layer, strict=True)}
    everything: list[nn.Parameter] = []
    layers: list[int] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                everything.append(p)
                layers.append(layer_of.get(id(p), UNWATCHED))
    return NonfiniteGuard(everything, layers)


def _floating(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.is_complex():
                out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


def find_forward_origin(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> tuple[str, str, int] | None:
    """Re-run ``model(*args, **kwargs)`` under ``torch.no_grad()`` and return ``(name, type
    name, non-finite count)`` of the first module, in execution (completion) order, whose
    output has non-finite values while its inputs were all finite; None when the forward is
    finite, the inputs came in non-finite, or anything failed (it never raises).

    Call it where the weights are the ones the step's forward used (the optimizer pre-hook,
    before the update) with the arguments and keyword arguments the root forward pre-hook
    captured. The torch RNG state (CPU, and every CUDA device when CUDA is initialised) is
    saved and restored around the re-run, so dropout draws the same masks it would have and the
    run's randomness is unchanged; every module's training flag is restored; the temporary
    hooks are removed even on error.
    Cost: one forward and one sync per module output (only ever on a non-finite step).
    """
    handles: list[RemovableHandle] = []
    modes = [(m, m.training) for m in model.modules()]
    cpu_state = torch.get_rng_state()
    cuda_states: list[torch.Tensor] | None = None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda_states = torch.cuda.get_rng_state_all()
        found: list[tuple[str, str, int]] = []

        def post(name: str, module: nn.Module, inputs: Any, output: Any) -> None:
            if found:
                return
            outs = _floating(output)
            count = sum(int((~torch.isfinite(t)).sum().item()) for t in outs)
            if count and all(bool(torch.isfinite(t).all()) for t in _floating(inputs)):
                found.append((name, type(module).__name__, count))

        for name, module in user_paths(model):
            handles.append(module.register_forward_hook(partial(post, name)))
        with torch.no_grad():
            model(*args, **(kwargs or {}))
        return found[0] if found else None
    except Exception:
        return None
    finally:
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass
        for module, training in modes:
            module.training = training
        try:
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
        except Exception:
            pass
