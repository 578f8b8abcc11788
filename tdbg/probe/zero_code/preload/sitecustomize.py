"""Preloaded by ``tdbg run`` through PYTHONPATH: starts tdbg's zero-code bootstrap, then the
``sitecustomize`` this one shadows. Never imports torch; nothing here may stop the script."""

from __future__ import annotations

import os
import sys


def _tdbg_preload() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    failure: Exception | None = None
    try:
        from tdbg.probe.zero_code import autowatch, launchers

        launcher = launchers.is_launcher()
    except Exception as exc:  # reported below, once, with the other failures
        autowatch, launcher, failure = None, False, exc  # type: ignore[assignment]
    # The script sees the sys.path and PYTHONPATH it would see run directly: the processes it
    # starts (spawned DataLoader workers, helper interpreters) are never preloaded — unless it
    # is torchrun, whose workers (the ranks) are what is to be watched.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    if not launcher:
        entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        rest = os.pathsep.join(p for p in entries if p and os.path.abspath(p) != here)
        if rest:
            os.environ["PYTHONPATH"] = rest
        else:
            os.environ.pop("PYTHONPATH", None)
    try:
        if failure is not None:
            raise failure
        autowatch.install()
    except Exception as exc:
        sys.stderr.write(
            f"tdbg: warning: the probe was not preloaded ({exc}); the script runs unmonitored\n"
        )
    # Chain to the sitecustomize this file shadows (a distribution's or a venv's), as Python
    # would have run it.
    try:
        from importlib.machinery import PathFinder
        from importlib.util import module_from_spec

        spec = PathFinder.find_spec("sitecustomize", sys.path)
        if spec is not None and spec.loader is not None:
            module = module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(exc).__name__}: {exc}\n"
        )


_tdbg_preload()
del _tdbg_preload
