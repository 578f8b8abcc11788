"""What the framework callbacks share; imports neither a framework nor torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tdbg.integrations")


def innermost(optimizer: Any) -> Any:
    """The torch optimizer under a wrapper (LightningOptimizer, Accelerate's
    AcceleratedOptimizer): the one whose step hooks fire on a real update."""
    for _ in range(8):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


class LazyClass:
    """``TdbgCallback``: ``mixin`` on the framework's callback base, built at first use (a
    module's ``__getattr__`` hands it out), so importing the module imports no framework."""

    def __init__(self, mixin: type, base: Callable[[], type]) -> None:
        self.mixin, self.base = mixin, base
        self.built: type | None = None

    def get(self) -> type:
        if self.built is None:
            self.built = type(
                "TdbgCallback",
                (self.mixin, self.base()),
                {"__module__": self.mixin.__module__, "__doc__": self.mixin.__doc__},
            )
        return self.built

    def module_getattr(self, module: str) -> Callable[[str], Any]:
        """The ``__getattr__`` for ``module`` (PEP 562) that hands out ``TdbgCallback``."""

        def __getattr__(name: str) -> Any:
            if name == "TdbgCallback":
                return self.get()
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

        return __getattr__


def failed(framework: str, what: str, exc: BaseException) -> None:
    logger.warning(f"tdbg: {framework} callback failed {what} ({exc!r}); training goes on")


class FailSafe:
    """What both callbacks share: a probe, hooks counting the optimizer's updates, and when a
    step of theirs fails, saying so once and stopping watching, never stopping training.
    Subclasses name their ``framework`` and set ``_hooks`` and ``_updates`` in ``__init__``."""

    framework = ""
    probe: Any = None
    _hooks: list[Any]
    _updates: int  # optimizer updates since the last probe.step()

    def _on_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._updates += 1

    def _live(self) -> bool:
        return self.probe is not None and not self.probe.closed

    def _stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        probe, self.probe = self.probe, None
        self._forget()
        if probe is not None:
            probe.close()

    def _forget(self) -> None:
        """What a subclass drops when it stops watching (before the probe closes)."""

    def _failed(self, what: str, exc: BaseException) -> None:
        """An error in the callback never stops training: say so once and stop watching."""
        failed(self.framework, what, exc)
        try:
            self._stop()
        except Exception:
            self.probe = None
