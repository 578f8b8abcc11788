"""Hooks that leave a watched model picklable and copyable: weak, and inert in any copy."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class InertHook:
    """What a tdbg hook becomes in a pickled or deep-copied module or optimizer: it does
    nothing, holds nothing, and pickles to itself (a loaded checkpoint needs no tdbg state)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return (InertHook, ())


class WeakHook:
    """A hook that calls a bound method of the probe's objects through a weak reference.

    torch keeps hooks in the module's (or optimizer's) own dicts, so ``torch.save(model)`` and
    ``copy.deepcopy(model)`` copy them. A bound method would drag the probe along — its socket,
    threads and locks cannot be pickled — and a copy (an EMA model, a best-model snapshot) would
    report into the original probe. This one pickles and copies as an :class:`InertHook`, and
    never keeps the probe alive by itself.
    """

    __slots__ = ("_method", "_args", "__weakref__")

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._args = args  # leading arguments (plain values: an index, a name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        return method(*self._args, *args, **kwargs)

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return (InertHook, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __copy__(self) -> InertHook:
        return InertHook()


# Under torch.compile the hooks run eagerly, outside the graph: dynamo neither traces the
# probe's clock reads (a graph break and a warning per hook) nor recompiles on its state.
WeakHook.__call__ = torch.compiler.disable(WeakHook.__call__)  # type: ignore[method-assign]
