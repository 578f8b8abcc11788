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
    all: a forward in another thread meanwhile is timed as ever. Writes go through to the
    module's own dict, so a hook registered or removed meanwhile (through the view) is so
    there too, and its handle keeps working after (it holds the view: kept while it may)."""

    __slots__ = ("own",)

    def __init__(self, own: dict[Any, Any]) -> None:
        super().__init__()
        for key, hook in own.items():  # a copy, not written through
            OrderedDict.__setitem__(self, key, hook)
        self.own = own

    def values(self) -> Any:
        return [hook for hook in super().values() if not is_tdbg_hook(hook)]

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.own[key] = value

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.own.pop(key, None)

    def move_to_end(self, key: Any, last: bool = True) -> None:  # register(prepend=True)
        super().move_to_end(key, last)
        if isinstance(self.own, OrderedDict) and key in self.own:
            self.own.move_to_end(key, last)


# (module's __dict__, attribute, its own dict, the view in its place, the keys it had then)
_Swap = tuple[dict[str, Any], str, dict[Any, Any], _ScriptsView, frozenset[Any]]
# Views that hooks were registered on while their module was scripted, holding those alone:
# their handles hold the view weakly and remove through it (a few views a process, if any).
_kept_views: list[_ScriptsView] = []


def _show_scripts_hooks_only(root: Any) -> list[_Swap]:
    """Every module under ``root`` has its hook dicts seen through views while it is scripted
    (any module: a hook may be added to one meanwhile). Its own dicts stay where they are."""
    swaps: list[_Swap] = []
    if not isinstance(root, nn.Module):
        return swaps
    try:
        for module in root.modules():
            attrs = module.__dict__
            for name in _SCRIPTED_HOOK_DICTS:
                hooks = attrs.get(name)
                if isinstance(hooks, dict) and not isinstance(hooks, _ScriptsView):
                    view = _ScriptsView(hooks)
                    swaps.append((attrs, name, hooks, view, frozenset(hooks)))
                    attrs[name] = view
    except Exception:  # never fail the user's scripting on tdbg's account: undo what moved
        _put_back(swaps)
        return []
    return swaps


def _put_back(swaps: list[_Swap]) -> None:
    """Each module's own dicts back (the views wrote through to them)."""
    for attrs, name, hooks, view, had in swaps:
        if attrs.get(name) is view:
            attrs[name] = hooks
        for key in [key for key in view if key in had]:
            OrderedDict.__delitem__(view, key)  # not through: their handles hold the own dict
        if view:
            with _lock:
                # Those emptied since (their hooks removed through them) go.
                _kept_views[:] = [kept for kept in _kept_views if kept]
                _kept_views.append(view)
