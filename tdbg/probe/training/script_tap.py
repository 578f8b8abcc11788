"""torch.jit.script takes a watched model (or its copy) as unwatched: tdbg hooks step aside."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn

from tdbg.probe.training.hook_refs import is_tdbg_forward, is_tdbg_hook

# The module hook dicts TorchScript compiles into a scripted module (it ignores the others).
_SCRIPTED_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_installed: list[bool] = []
_lock = threading.RLock()  # a freed dict's finalizer may run while it is held


def install() -> None:
    """Wrap ``torch.jit._recursive.create_script_module``, once per process and for good.

    ``torch.jit.script(model)`` compiles every forward (pre-)hook in the model's dicts from its
    source, and a tdbg hook has none (nor a ``__name__``): scripting a watched model raised
    ``AttributeError`` where the same model unwatched scripts. While the wrapper runs, each
    module's hook dicts are seen through a view whose ``values()`` (all TorchScript reads of
    them) leaves tdbg's out, so the scripted module carries only the script's own hooks. It
    stays after the last probe closes: a copy of a watched model whose class pickles around
    ``__getstate__`` (state_tap), or one loaded from a checkpoint an older tdbg saved, keeps
    an inert tdbg hook.
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
        wrappers = _set_wrappers_aside(nn_module)
        views = _show_scripts_hooks_only(nn_module)
        try:
            return original(nn_module, *args, **kwargs)
        finally:
            _put_back(views)
            _put_wrappers_back(wrappers)

    return create_script_module


class _ScriptsView(OrderedDict[Any, Any]):
    """A module's hook dict as TorchScript reads it (``values()``, and nothing else): without
    tdbg's hooks, those registered meanwhile too. Everything else reads and writes the
    module's own dict, held weakly: a forward in another thread meanwhile runs every hook there
    is (and none removed), a hook registered meanwhile lands there, and its handle (which holds
    the view) removes it through the view later (views are kept while their dict lives). A
    pickle or a copy of it is a plain ``OrderedDict`` of the hooks."""

    __slots__ = ("_own",)

    def __init__(self, own: dict[Any, Any]) -> None:
        super().__init__()  # holds nothing itself
        self._own = weakref.ref(own)

    def _dict(self) -> dict[Any, Any]:
        own = self._own()
        return own if own is not None else {}

    def values(self) -> Any:
        return [hook for hook in self._dict().values() if not is_tdbg_hook(hook)]

    def keys(self) -> Any:
        return self._dict().keys()

    def items(self) -> Any:
        return self._dict().items()

    def __iter__(self) -> Any:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, key: object) -> bool:
        return key in self._dict()

    def __getitem__(self, key: Any) -> Any:
        return self._dict()[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self._dict().get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._dict()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._dict()[key]

    def pop(self, key: Any, *default: Any) -> Any:
        return self._dict().pop(key, *default)

    def move_to_end(self, key: Any, last: bool = True) -> None:  # register(prepend=True)
        own = self._dict()
        if isinstance(own, OrderedDict):
            own.move_to_end(key, last)

    def copy(self) -> Any:
        return OrderedDict(self._dict())

    def __reduce__(self) -> Any:
        return (OrderedDict, (list(self._dict().items()),))

    def __repr__(self) -> str:
        return f"_ScriptsView({self._dict()!r})"


# (module's __dict__, attribute, its own dict, the view in its place)
_Swap = tuple[dict[str, Any], str, dict[Any, Any], _ScriptsView]
# Each hook dict's view, while the dict lives: a handle registered through a view holds it
# weakly, and removes through it after the window (a view holds nothing but a weak reference).
_views: dict[int, _ScriptsView] = {}  # by id of the dict (unhashable); gone with the dict


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
                if isinstance(hooks, OrderedDict) and not isinstance(hooks, _ScriptsView):
                    with _lock:
                        view = _views.get(id(hooks))
                        if view is None or view._own() is not hooks:
                            view = _views[id(hooks)] = _ScriptsView(hooks)
                            weakref.finalize(hooks, _forget, id(hooks), view)
                    swaps.append((attrs, name, hooks, view))
                    attrs[name] = view
    except Exception:  # never fail the user's scripting on tdbg's account: undo what moved
        _put_back(swaps)
        return []
    return swaps


def _set_wrappers_aside(root: Any) -> list[tuple[dict[str, Any], Any]]:
    """Take tdbg's forward wrappers (forward_tap) out of the modules' ``__dict__`` while they
    are scripted: TorchScript compiles the class's forward, from its source, with its globals
    (it would read the wrapper's, and script the wrapper as a function attribute). A forward
    another thread runs meanwhile runs unwatched (the window lasts as long as the scripting)."""
    aside: list[tuple[dict[str, Any], Any]] = []
    if not isinstance(root, nn.Module):
        return aside
    try:
        for module in root.modules():
            attrs = module.__dict__
            wrapper = attrs.get("forward")
            if is_tdbg_forward(wrapper):
                del attrs["forward"]
                aside.append((attrs, wrapper))
    except Exception:  # never fail the user's scripting on tdbg's account
        pass
    return aside


def _put_wrappers_back(aside: list[tuple[dict[str, Any], Any]]) -> None:
    for attrs, wrapper in aside:
        attrs.setdefault("forward", wrapper)  # unless the script set its own meanwhile


def _forget(key: int, view: _ScriptsView) -> None:
    """A hook dict was freed: its view goes (unless another dict's took its id since)."""
    with _lock:
        if _views.get(key) is view:
            del _views[key]


def _put_back(swaps: list[_Swap]) -> None:
    """Each module's own dicts back in place (the views wrote to them)."""
    for attrs, name, hooks, view in swaps:
        if attrs.get(name) is view:
            attrs[name] = hooks
