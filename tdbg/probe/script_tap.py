"""torch.jit.script takes a watched model (or its copy) as unwatched: tdbg hooks step aside."""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn

from tdbg.probe.hook_refs import INERT_EVENT, WeakHook

# The module hook dicts TorchScript compiles into a scripted module (it ignores the others).
_SCRIPTED_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_installed: list[bool] = []
_lock = threading.Lock()


def install() -> None:
    """Wrap ``torch.jit._recursive.create_script_module``, once per process and for good.

    ``torch.jit.script(model)`` compiles every forward (pre-)hook in the model's dicts from its
    source, and a tdbg hook has none (nor a ``__name__``): scripting a watched model raised
    ``AttributeError`` where the same model unwatched scripts. While the wrapper runs, each
    module's hook dicts are seen through a view whose ``values()`` (all TorchScript reads of
    them) leaves tdbg's out, so the scripted module carries only the script's own hooks. It
    stays after the last probe closes: a copy of a watched model (an EMA, a best-model
    snapshot, one loaded from ``torch.save``) keeps an inert tdbg hook.
    Every scripting path goes through this function (``torch.jit.script`` of a module, a
    ``ScriptModule`` subclass, ``torch.jit.trace``'s module), looked up at each call.
    """
    with _lock:
        if _installed:
            return
        _installed.append(True)
        try:
            from torch.jit import _recursive
        except Exception:  # a torch without TorchScript: nothing to script
            return
        original = getattr(_recursive, "create_script_module", None)
        if original is not None:
            _recursive.create_script_module = _set_aside_while(original)


def _set_aside_while(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
        views = _show_scripts_hooks_only(nn_module)
        try:
            return original(nn_module, *args, **kwargs)
        finally:
            _put_back(views)

    return create_script_module


def is_tdbg_hook(hook: Any) -> bool:
    """A hook tdbg registered (live, or inert in a copy), as opposed to the script's own."""
    if isinstance(hook, WeakHook):
        return True
    function = hook
    if isinstance(hook, functools.partial):
        if hook.func is sys.audit and hook.args[:1] == (INERT_EVENT,):
            return True  # what a tdbg hook becomes in a copy or a pickle
        function = hook.func
    owner = getattr(function, "__module__", None)
    return isinstance(owner, str) and owner.startswith("tdbg.")


class _ScriptsView(OrderedDict[Any, Any]):
    """A module's hook dict as TorchScript reads it (``values()``, and nothing else): without
    tdbg's hooks, those registered meanwhile too. ``items()`` (what a forward runs) keeps them
    all: a forward in another thread meanwhile is timed as ever."""

    def values(self) -> Any:
        return [hook for hook in super().values() if not is_tdbg_hook(hook)]


# (module's __dict__, attribute, its own dict, the view in its place, the keys it had then)
_Swap = tuple[dict[str, Any], str, dict[Any, Any], _ScriptsView, frozenset[Any]]


def _show_scripts_hooks_only(root: Any) -> list[_Swap]:
    """Each module under ``root`` whose hook dicts hold a tdbg hook gets a view in their place
    while it is scripted. Its own dicts stay as they are (a hook removed meanwhile through its
    handle is removed from them, and stays removed)."""
    swaps: list[_Swap] = []
    if not isinstance(root, nn.Module):
        return swaps
    try:
        for module in root.modules():
            attrs = module.__dict__
            for name in _SCRIPTED_HOOK_DICTS:
                hooks = attrs.get(name)
                if isinstance(hooks, dict) and any(is_tdbg_hook(h) for h in hooks.values()):
                    view = _ScriptsView(hooks)
                    swaps.append((attrs, name, hooks, view, frozenset(hooks)))
                    attrs[name] = view
    except Exception:  # never fail the user's scripting on tdbg's account: undo what moved
        _put_back(swaps)
        return []
    return swaps


def _put_back(swaps: list[_Swap]) -> None:
    """Each module's own dicts back; a hook registered on the view meanwhile joins them."""
    for attrs, name, hooks, view, had in swaps:
        if attrs.get(name) is view:
            attrs[name] = hooks
        for key, hook in list(view.items()):
            if key not in had:
                hooks[key] = hook
