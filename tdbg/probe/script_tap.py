"""torch.jit.script takes a watched model (or its copy) as unwatched: tdbg hooks step aside."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
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
    ``AttributeError`` where the same model unwatched scripts. While the wrapper runs, tdbg's
    hooks leave the dicts and come back in their places after, so the scripted module carries
    only the script's own hooks. It stays after the last probe closes: a copy of a watched model
    (an EMA, a best-model snapshot, one loaded from ``torch.save``) keeps an inert tdbg hook.
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
        set_aside = _take_tdbg_hooks(nn_module)
        try:
            return original(nn_module, *args, **kwargs)
        finally:
            _put_back(set_aside)

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


_SetAside = list[tuple[dict[Any, Any], list[tuple[Any, Any]]]]


def _take_tdbg_hooks(root: Any) -> _SetAside:
    """Remove tdbg's hooks from every module under ``root``; what to put back, and where."""
    set_aside: _SetAside = []
    if not isinstance(root, nn.Module):
        return set_aside
    try:
        for hooks in _scripted_hook_dicts(root):
            if any(is_tdbg_hook(hook) for hook in hooks.values()):
                before = list(hooks.items())
                for key, hook in before:
                    if is_tdbg_hook(hook):
                        del hooks[key]
                set_aside.append((hooks, before))
    except Exception:  # never fail the user's scripting on tdbg's account: put back what moved
        _put_back(set_aside)
        return []
    return set_aside


def _scripted_hook_dicts(root: nn.Module) -> Iterator[dict[Any, Any]]:
    for module in root.modules():
        for name in _SCRIPTED_HOOK_DICTS:
            hooks = module.__dict__.get(name)
            if isinstance(hooks, dict):
                yield hooks


def _put_back(set_aside: _SetAside) -> None:
    """Each dict as it was, in its order; a hook added meanwhile stays, after them."""
    for hooks, before in set_aside:
        kept = {key for key, _ in before}
        added = [(key, hook) for key, hook in hooks.items() if key not in kept]
        hooks.clear()
        hooks.update(before)
        hooks.update(added)
