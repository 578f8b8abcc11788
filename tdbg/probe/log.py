"""The probe's own logging: stderr only, WARNING and above, each message at most once a minute."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("tdbg")
REPEAT_SECONDS = 60.0
_last: dict[str, float] = {}
_lock = threading.Lock()

if not logger.handlers:
    _handler = logging.StreamHandler()  # stderr: the probe never writes to stdout
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def warn(message: str) -> None:
    """Log ``message`` unless the same text was logged within the last minute."""
    now = time.monotonic()
    # Non-blocking: a caller in a signal handler or gc callback must never wait here.
    if not _lock.acquire(blocking=False):
        return
    try:
        if now - _last.get(message, -REPEAT_SECONDS) < REPEAT_SECONDS:
            return
        _last[message] = now
        if len(_last) > 1024:
            _last.clear()
    finally:
        _lock.release()
    logger.warning(message)
