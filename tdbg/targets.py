"""Which run a command's TARGET argument names, and the one-line error when it names none."""

from __future__ import annotations

import time

from tdbg.client import resolve_target
from tdbg.runtime import discover, runtime_dir


class CliError(Exception):
    """A one-line error for the user; exit code 2."""


def pick_target(target: str | None, wait: float | None) -> str:
    """The socket to attach to: the given target, or the only live run (waiting for one)."""
    if target is not None:
        return resolve_target(target)
    deadline = time.monotonic() + (wait or 0.0)
    while True:
        entries = discover()
        if len(entries) == 1:
            return str(entries[0].socket)
        if len(entries) > 1:
            listing = "; ".join(f"{e.socket} ({e.name})" for e in entries[:4])
            raise CliError(f"{len(entries)} runs found, name one: {listing}")
        if time.monotonic() >= deadline:
            raise CliError(f"no tdbg run found in {runtime_dir()} (start one with tdbg.watch)")
        time.sleep(0.2)
