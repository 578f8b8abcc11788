"""Waits on a main thread that still see Ctrl-C: short timed slices, never one untimed wait."""

from __future__ import annotations

import queue
import threading
from typing import TypeVar

# The kernel may hand a terminal's SIGINT to any thread of the process; Python then only flags
# it for the main thread, which sees the flag when it next runs. A main thread blocked in a lock
# wait with no timeout never runs: it wakes this often to look.
WAKE_SECONDS = 0.2

T = TypeVar("T")


def wait_set(event: threading.Event) -> None:
    """Return once ``event`` is set; a Ctrl-C meanwhile raises KeyboardInterrupt at once."""
    while not event.wait(WAKE_SECONDS):
        pass


def next_item(items: queue.Queue[T]) -> T:
    """The next item of ``items``, waited for; a Ctrl-C meanwhile raises KeyboardInterrupt."""
    while True:
        try:
            return items.get(timeout=WAKE_SECONDS)
        except queue.Empty:
            continue
