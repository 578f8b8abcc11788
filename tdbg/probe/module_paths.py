"""Module paths as the user's model names them: the segments torch's wrappers add left out."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

# A wrapper's class name -> the attribute holding the module it wraps. Watching
# ``torch.compile(model)`` named every layer ``_orig_mod.…``, a DDP model ``module.…``: the
# same model's layers read differently depending on how it runs (and the prefix takes a
# third of an 80-column gradient table). Class names, not imports: FSDP, checkpointing and
# Fabric need not be importable.
_WRAPPED_CHILD = {
    "OptimizedModule": "_orig_mod",  # torch.compile
    "DataParallel": "module",
    "DistributedDataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "_FabricModule": "_forward_module",  # Lightning Fabric
}


def user_paths(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` (each module once), each path without the segments a
    wrapper adds: ``_orig_mod.0`` reads ``0``, as in the model the user wrote. A wrapper and
    the module it wraps share a path; a path that would then name two modules of the user's
    (a wrapper that has parameters of its own, FSDP's flat one) keeps its full spelling."""
    dropped: dict[str, str] = {}  # raw path of a wrapper -> the child segment it adds
    cleaned: dict[str, str] = {}  # raw path -> the user's path
    taken: set[str] = set()
    for path, module in model.named_modules():
        if path:
            parent, _, segment = path.rpartition(".")
            base = cleaned.get(parent, parent)
            if dropped.get(parent) == segment:
                name = base
            else:
                name = f"{base}.{segment}" if base else segment
        else:
            name = ""
        wrapped = _WRAPPED_CHILD.get(type(module).__name__)
        if (
            wrapped is not None
            and isinstance(getattr(module, wrapped, None), nn.Module)
            and sum(1 for _ in module.children()) == 1  # a user class so named has more
        ):
            dropped[path] = wrapped
            if next(module.parameters(recurse=False), None) is not None:
                taken.add(name)  # its own parameters are a layer under this name
        elif name in taken:
            name = path
        else:
            taken.add(name)
        cleaned[path] = name
        yield name, module
