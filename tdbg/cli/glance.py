"""A run's state at a glance: a live run's history until ``synced``, or a recording whole."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from tdbg.cli.args import positive_float
from tdbg.cli.errors import CliError
from tdbg.cli.target_args import attach_target
from tdbg.connect.targets import Recording, resolve

if TYPE_CHECKING:
    from tdbg.model.run_state import RunState

SYNC_SECONDS = 5.0  # how long a live run may take to send its history (the --timeout default)


def read_state(text: str, args: argparse.Namespace) -> RunState:
    """A run's state from its history (a live run: until ``synced``; a recording: whole)."""
    from tdbg.model.run_state import RunState

    target = resolve(text)
    if isinstance(target, Recording):
        from tdbg.model.recordings import load_run
        from tdbg.recording.reader import RecordingError

        try:
            return load_run(target.path)
        except RecordingError as exc:
            raise CliError(str(exc)) from None
    state = RunState()
    client = attach_target(target, text, args.timeout, args)
    try:
        state.read_history(client, time.monotonic() + args.timeout)
    finally:
        client.close()
    return state


def the_only_run() -> str:
    """The one local run's socket, for a command given no TARGET; else a one-line error."""
    from tdbg.connect.runtime import discover, runtime_dir

    entries = discover()
    if len(entries) != 1:
        raise CliError(
            f"no tdbg runs in {runtime_dir()}"
            if not entries
            else f"{len(entries)} runs here: name one (tdbg ls lists them)"
        )
    return str(entries[0].socket)


def add_history_timeout(p: argparse.ArgumentParser) -> None:
    """``--timeout S``: how long a command reading a live run's history waits for it."""
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=SYNC_SECONDS,
        metavar="S",
        help=f"wait at most S seconds for a live run's history (default {SYNC_SECONDS:g})",
    )
