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
    """What both callbacks do when a step of theirs fails: say so once and stop watching,
    never stopping training. Subclasses name their ``framework`` and define ``_stop``."""

    framework = ""
    probe: Any = None

    def _stop(self) -> None:
        raise NotImplementedError

    def _failed(self, what: str, exc: BaseException) -> None:
        """An error in the callback never stops training: say so once and stop watching."""
        failed(self.framework, what, exc)
        try:
            self._stop()
        except Exception:
            self.probe = None
