"""Reading a pseudo-terminal a child process wrote to, for tests that give a script a pty."""

from __future__ import annotations

import os


def read_pty(master: int) -> bytes:
    """Everything written to the pty whose master end is ``master``, until every writer has
    closed it (EIO on Linux, or end of file)."""
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed
            return out
        if not chunk:
            return out
        out += chunk
