"""Why a TARGET names no run: ``TargetError``, its reasons, and the one wording per case.

A module of its own, below ``targets``, ``nodes`` and the bridge's contract, so that each of them
words its errors here without importing the others (they would import each other in a circle).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from tdbg.connect.client import ConnectError
from tdbg.connect.runtime import RunEntry

# Why a TARGET names no run; the bridge turns these into its exit codes (bridge_contract.py).
Reason = Literal["invalid", "missing", "no_run", "several", "recording"]

SHOWN = 4  # runs named in a "several runs" error


class TargetError(ConnectError):
    """A TARGET names no run we can attach to; ``str()`` is the one line the user sees (exit
    code 2) and ``reason`` says which case it is."""

    def __init__(self, message: str, reason: Reason = "invalid") -> None:
        super().__init__(message)
        self.reason: Reason = reason


# --- the wordings: one function per error case ----------------------------------------------


def empty_error() -> TargetError:
    return TargetError("TARGET is empty")


def missing_error(text: str) -> TargetError:
    return TargetError(f"no such socket, metadata file, directory or run: {text}", "missing")


def no_run_error(directory: Path) -> TargetError:
    return TargetError(f"no tdbg run found in {directory} (start one with tdbg.watch)", "no_run")


def several_error(where: str, entries: Sequence[RunEntry]) -> TargetError:
    """``where`` is ``in DIR`` or ``named NAME``."""
    shown = "; ".join(f"{e.socket} ({e.name}, pid {e.pid})" for e in entries[:SHOWN])
    more = f"; and {len(entries) - SHOWN} more" if len(entries) > SHOWN else ""
    return TargetError(f"{len(entries)} runs {where}, name one: {shown}{more}", "several")


def bad_metadata_error(text: str, why: object) -> TargetError:
    return TargetError(f"{text} is not a tdbg run metadata file ({why})")


def not_a_run_file_error(text: str) -> TargetError:
    return TargetError(f"{text} is not a tdbg recording, nor a probe's socket")


def recording_error(text: str) -> TargetError:
    return TargetError(
        f"{text} is a recording: a recording cannot run commands "
        "(tdbg dump and tdbg-tui replay read it)",
        "recording",
    )


def not_ssh_error(text: str, hint: str) -> TargetError:
    return TargetError(f"{text!r}: {hint}")
