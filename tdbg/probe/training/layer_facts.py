"""What each watched layer is: module type, dtype, device, bytes, trainable elements, optimizer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tdbg.probe.training.gradients import Layer


def layer_facts(
    layers: Sequence[Layer], optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, list[str] | list[int]]:
    """The model summary's per-layer columns, as the ``layers`` message carries them (each list
    in layer order): ``types``, ``dtypes`` and ``devices`` (several joined with ``+``: a layer
    whose parameters differ), ``bytes``, ``trainable`` (elements with ``requires_grad``) and
    ``optimizer`` (the index in the run's optimizers of the first one that updates any of its
    parameters; -1: none does) and ``lr_group`` (that optimizer's param group holding them, as
    its index among the step's ``lr`` columns: every optimizer's groups in turn; -1: none). Read
    once per layout (at watch() and when the layers change),
    never per step; a gone layer (no parameters) has empty strings and zeros."""
    holder: dict[int, int] = {}
    column: dict[int, int] = {}  # parameter -> its group's lr column
    first_column = 0
    for index, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                holder.setdefault(id(param), index)
                column.setdefault(id(param), first_column + g)
        first_column += len(optimizer.param_groups)
    types: list[str] = []
    dtypes: list[str] = []
    devices: list[str] = []
    sizes: list[int] = []
    trainable: list[int] = []
    updated_by: list[int] = []
    lr_group: list[int] = []
    for layer in layers:
        params = layer.params
        types.append(layer.module_type)
        dtypes.append("+".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})))
        devices.append("+".join(sorted({str(p.device) for p in params})))
        sizes.append(sum(p.numel() * p.element_size() for p in params))
        trainable.append(sum(p.numel() for p in params if p.requires_grad))
        updated_by.append(min((holder[id(p)] for p in params if id(p) in holder), default=-1))
        lr_group.append(min((column[id(p)] for p in params if id(p) in column), default=-1))
    return {
        "types": types,
        "dtypes": dtypes,
        "devices": devices,
        "bytes": sizes,
        "trainable": trainable,
        "optimizer": updated_by,
        "lr_group": lr_group,
    }
