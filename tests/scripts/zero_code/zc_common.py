"""Helpers of the zero-code test scripts: an opt-in watch() and a hold before exit."""

from __future__ import annotations

import os
import time
from typing import Any


def watch_if_asked(model: Any, optimizer: Any) -> Any:
    """With ZC_WATCH=1 the script watches itself, as a user would: the reference run."""
    if os.environ.get("ZC_WATCH") != "1":
        return None
    import tdbg

    return tdbg.watch(model, optimizer, grad_every=1)


def hold() -> None:
    """Wait (at most 60 s) for the file named by ZC_HOLD, so a test can read every step first;
    the script never hangs when nobody attaches."""
    path = os.environ.get("ZC_HOLD")
    deadline = time.monotonic() + 60
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
