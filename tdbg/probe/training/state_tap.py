"""A watched module pickles and copies without tdbg's hooks or forward wrapper: ``__getstate__``."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import nn

from tdbg.probe.training.hook_refs import is_tdbg_forward, is_tdbg_hook

# The module hook dicts tdbg registers in, and the dicts torch keys by those hooks' ids.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_ID_DICTS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_WRAPPED = "__tdbg_drops_hooks__"
_lock = threading.Lock()


def cover(module: nn.Module) -> None:
    """From now on (for good, as the other taps), ``torch.save``, ``pickle`` and ``copy`` of
    any module of ``module``'s class leave tdbg's hooks out of the copy.

    Each tdbg hook already pickles and copies as an inert stdlib call (hook_refs), so a copy
    never reports into the probe; but a hook is still there, and where tdbg is not installed
    nothing can tell it apart: ``torch.compile(fullgraph=True)`` refuses its graph break and
    ``torch.jit.script`` its missing source. So the class that defines the module's
    ``__getstate__`` (``nn.Module`` for most, ``RNNBase`` for the RNNs, a script's own) gets
    one that drops them from the state it returns (a copy of the module's ``__dict__``: the
    live module keeps its hooks). A class whose pickling bypasses ``__getstate__`` keeps the
    inert hook. Called where a hook is registered, never per step."""
    owner, getstate = _getstate_of(type(module))
    if getstate is None or getattr(getstate, _WRAPPED, False):
        return
    with _lock:
        getstate = owner.__dict__.get("__getstate__")
        if not callable(getstate) or getattr(getstate, _WRAPPED, False):
            return
        try:
            owner.__getstate__ = _dropping_hooks(getstate)  # type: ignore[method-assign,assignment]
        except (TypeError, AttributeError):  # a class that takes no new attributes
            pass


def covers(module: nn.Module) -> bool:
    """Copies of ``module`` leave tdbg's hooks and wrapper out (:func:`cover` took its class)."""
    _, getstate = _getstate_of(type(module))
    return bool(getattr(getstate, _WRAPPED, False))


def _getstate_of(cls: type) -> tuple[type, Any]:
    """The class in ``cls``'s MRO that defines ``__getstate__``, and that function."""
    for owner in cls.__mro__:
        getstate = owner.__dict__.get("__getstate__")
        if getstate is not None:
            return owner, getstate
    return cls, None


def _dropping_hooks(getstate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(getstate)
    def __getstate__(self: Any) -> Any:
        state = getstate(self)
        if isinstance(state, dict):
            live: Any = getattr(self, "__dict__", None)
            if state is live:
                state = state.copy()  # a class that returns its live __dict__: left as it is
            drop_tdbg_hooks(state)
        return state

    setattr(__getstate__, _WRAPPED, True)
    return __getstate__


def drop_tdbg_hooks(state: dict[str, Any]) -> None:
    """Replace, in a module's state, each hook dict holding a tdbg hook by a plain copy
    without them (the script's own hooks kept, in order), and forget their ids; and leave
    out tdbg's wrapper of its forward (forward_tap): the copy calls its class's."""
    if is_tdbg_forward(state.get("forward")):
        del state["forward"]
    dropped: set[Any] = set()
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if not isinstance(hooks, dict):
            continue
        items = list(hooks.items())  # one C call: another thread may register meanwhile
        ours = {key for key, hook in items if is_tdbg_hook(hook)}
        if ours:
            state[name] = OrderedDict((key, hook) for key, hook in items if key not in ours)
            dropped |= ours
    if not dropped:
        return
    for name in _HOOK_ID_DICTS:
        ids = state.get(name)
        if isinstance(ids, dict) and not dropped.isdisjoint(ids):
            kept = [(key, value) for key, value in list(ids.items()) if key not in dropped]
            state[name] = OrderedDict(kept)
