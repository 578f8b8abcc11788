"""How a process that has just ended ended, read from /proc before its parent reaps it (Linux)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

EXIT_CODE_FIELD = 52  # /proc/PID/stat's 1-based field: the wait status (Linux 3.5 and later)


def exit_status(pid: int, wait: float = 0.5) -> str | None:
    """``"exit N"`` or ``"killed by SIGNAME"`` for a process that ended and is not reaped yet
    (a zombie: its parent, torchrun's agent say, has not waited for it); None when that cannot
    be known: still running after ``wait`` seconds, already reaped, or no /proc."""
    deadline = time.monotonic() + wait
    while True:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None  # reaped (or never there)
        # Fields after the command name, which is in parentheses and may hold spaces: field 3
        # (the state) is the first.
        fields = text[text.rfind(")") + 2 :].split()
        if fields and fields[0] == "Z" and len(fields) > EXIT_CODE_FIELD - 3:
            return describe_wait_status(int(fields[EXIT_CODE_FIELD - 3]))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def describe_wait_status(status: int) -> str:
    """A wait status in words: ``"exit 1"``, ``"killed by SIGKILL"``."""
    if status & 0x7F:
        number = status & 0x7F
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}"
    return f"exit {(status >> 8) & 0xFF}"
