"""tdbg: a live PyTorch training monitor in the terminal; public API, importing nothing heavy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Probe", "__version__", "watch"]

if TYPE_CHECKING:
    from tdbg.probe.watch import Probe, watch


def __getattr__(name: str) -> Any:
    # torch is imported only when the probe is first used, so `import tdbg` stays cheap.
    if name in ("watch", "Probe"):
        from tdbg.probe import watch as _watch_module

        return getattr(_watch_module, name)
    raise AttributeError(f"module 'tdbg' has no attribute {name!r}")
