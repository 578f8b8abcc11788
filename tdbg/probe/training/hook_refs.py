"""Hooks that leave a watched model picklable, copyable and compilable: weak, inert in a copy."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

# What a tdbg hook becomes in a pickled or copied module or optimizer: ``sys.audit(INERT_EVENT,
# *hook arguments)``, a stdlib call that takes any arguments and returns None (the value that
# tells torch a hook changed nothing). It pickles by reference to ``functools.partial`` and
# ``sys.audit`` alone, so a checkpoint saved while watched loads where tdbg is not installed.
# It does nothing unless an audit hook (PEP 578) listens, which then sees this event's name.
INERT_EVENT = "tdbg.inert_hook"
# Looked up once: dynamo knows this function itself (under tracing it reads True), so an alias
# keeps that, and the hooks skip two attribute lookups on every call (one Python frame in
# eager mode).
is_compiling = torch.compiler.is_dynamo_compiling


class _CompilingFlag:
    """A torch without ``torch.compiler._is_compiling_flag``: the flag asks is_compiling()."""

    @property
    def _is_compiling_flag(self) -> bool:
        return bool(torch.compiler.is_compiling())


# Whether anything traces the model, torch.export included (a non-strict export calls the
# module with fake tensors, outside dynamo): forward hooks ask ``is_compiling() or
# COMPILE_STATE._is_compiling_flag``. That is torch.compiler.is_compiling() (two Python frames
# in eager mode: it asks torch.jit.is_scripting()) in one frame and one attribute read. The
# dynamo check comes first: dynamo reads it as a constant and never reaches the flag, which it
# would guard on (and recompile the model at every call).
COMPILE_STATE: Any = (
    torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()
)


# Set on the probe's wrapper of a module's forward (forward_tap), to the probe's hooks weakly:
# how state_tap, script_tap and the replica tap know it from the script's own.
FORWARD_MARK = "__tdbg_forward__"


def is_tdbg_forward(value: Any) -> bool:
    """``value`` (a module's instance ``forward``) is tdbg's wrapper."""
    return callable(value) and getattr(value, FORWARD_MARK, None) is not None


def _written_into_call(*args: Any, **kwargs: Any) -> None:
    raise TypeError("this hook's work is written into its __call__")


def inert_hook() -> Callable[..., None]:
    """A stdlib-only no-op hook, as a copied or unpickled tdbg hook is."""
    return functools.partial(sys.audit, INERT_EVENT)


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


class WeakHook:
    """A hook that calls a bound method of the probe's objects through a weak reference.

    torch keeps hooks in the module's (or optimizer's) own dicts, so ``torch.save(model)`` and
    ``copy.deepcopy(model)`` copy them. A bound method would drag the probe along — its socket,
    threads and locks cannot be pickled — and a copy (an EMA model, a best-model snapshot) would
    report into the original probe. This one pickles and copies as :func:`inert_hook` (no tdbg
    needed to load it), and never keeps the probe alive by itself. (A module's own pickles and
    copies leave it out altogether: state_tap; this is for the rest, an optimizer's hook dict
    copied by hand, a class that pickles around ``__getstate__``.)

    Under ``torch.compile`` it runs eagerly, outside the graph (a graph break): dynamo neither
    traces the probe's clock reads nor recompiles on its state. That suits optimizer hooks;
    forward hooks use :class:`ForwardHook`, which ``fullgraph=True`` accepts.
    """

    __slots__ = ("_owner", "_function", "_args", "__weakref__")

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        # The bound method's object, weakly, and its plain function: what WeakMethod keeps,
        # without its Python-level __call__ (three more calls on every hook, where the loop's
        # caches are cold).
        self._owner = weakref.ref(method.__self__)  # type: ignore[attr-defined]
        self._function: Callable[..., Any] = method.__func__  # type: ignore[attr-defined]
        self._args = args  # leading arguments (plain values: an index, a name)

    @classmethod
    def owned_by(cls, owner: Any, *args: Any) -> WeakHook:
        """A hook whose subclass writes its work into ``__call__`` (one frame fewer a call):
        the owner, weakly, and the leading arguments; no method."""
        hook = cls.__new__(cls)
        hook._owner = weakref.ref(owner)
        hook._function = _written_into_call
        hook._args = args
        return hook

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is None:
            return None
        return self._function(owner, *self._args, *args, **kwargs)

    # Eager where dynamo traces (a graph break), the check inline: one frame per call in eager mode.
    _outside_graph = torch.compiler.disable(_call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return self._outside_graph(*args, **kwargs)
        owner = self._owner()
        if owner is None:
            return None
        return self._function(owner, *self._args, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (functools.partial, (sys.audit, INERT_EVENT))

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return inert_hook()

    def __copy__(self) -> Callable[..., None]:
        return inert_hook()


class ForwardHook(WeakHook):
    """A module forward (pre-)hook: as :class:`WeakHook` in eager mode; inside a region that
    ``torch.compile`` traces it is a no-op the graph absorbs (no graph break, so
    ``fullgraph=True`` compiles), and the compiled forward is timed as part of the step
    rather than split into its own phase."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_compiling() or COMPILE_STATE._is_compiling_flag:
            return None
        owner = self._owner()
        if owner is None:
            return None
        return self._function(owner, *self._args, *args, **kwargs)
