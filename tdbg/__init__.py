"""tdbg: a live PyTorch training monitor in the terminal; public API, importing nothing heavy."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"
__all__ = ["Probe", "__version__", "log", "watch"]

if TYPE_CHECKING:
    from tdbg.probe.watch import Probe, watch


def __getattr__(name: str) -> Any:
    # torch is imported only when the probe is first used, so `import tdbg` stays cheap.
    if name in ("watch", "Probe"):
        from tdbg.probe import watch as _watch_module

        return getattr(_watch_module, name)
    raise AttributeError(f"module 'tdbg' has no attribute {name!r}")


def log(metrics: Any = None, /, *, step: Any = None, **scalars: Any) -> None:
    """Record your own metrics — ``tdbg.log(val_loss=v, acc=a)`` — into the run's probe (from
    ``watch()`` or ``tdbg run``). A no-op, importing nothing, when nothing is watched."""
    watching = sys.modules.get("tdbg.probe.watch")
    if watching is not None:
        watching.log(metrics, step=step, **scalars)
