"""What a TARGET names (``resolve``) and attaching to it (``attach``).

A TARGET is what a user types after ``tdbg dump``, ``tdbg profile``, ``tdbg-tui`` or
``tdbg bridge --socket``: a socket path, a run's ``.json`` metadata, a runtime directory, a
run's name or pid (looked up in the runtime directory), a recording file, an
``ssh://[user@]host[:port][/path]`` URL, or nothing (the only local run, or wait for one). A
name that the ranks of one distributed job share names that job (``Job``).
Every entry point asks ``resolve`` and dispatches on the kind it returns; every way a TARGET
can name no run is a ``TargetError`` worded once in ``target_errors``, so the CLI, the TUI and
the bridge say the same thing for the same mistake.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.jobs import job_of
from tdbg.connect.runtime import RunEntry, discover, runtime_dir, waiting_for_run
from tdbg.connect.sshurl import SshTarget, SshUrlError, is_ssh_url, parse_ssh_url
from tdbg.connect.target_errors import (
    TargetError,
    bad_metadata_error,
    empty_error,
    missing_error,
    no_run_error,
    not_a_run_file_error,
    recording_error,
    several_error,
)
from tdbg.recording.reader import is_recording

if TYPE_CHECKING:
    from tdbg.connect.ssh import RemoteOptions

TARGET_HELP = (
    "socket path, run .json, directory, run name or pid, recording file, "
    "or ssh://[user@]host[:port][/path]"
)

POLL_INTERVAL = 0.2  # seconds between looks at the runtime directory while waiting for a run


@dataclass(frozen=True)
class LocalSocket:
    """A probe's socket on this machine; ``entry`` is the run's metadata when discovery lists
    it as live (a socket may have been named directly, with no metadata beside it)."""

    path: Path
    entry: RunEntry | None = None


@dataclass(frozen=True)
class Recording:
    """A recording file (it starts with the recording magic): read, never connected to."""

    path: Path


@dataclass(frozen=True)
class Remote:
    """A host reached with the system ssh and ``tdbg bridge`` there (its path, if any, is
    resolved by the bridge on that host)."""

    ssh: SshTarget


@dataclass(frozen=True)
class Job:
    """A bare name that the live ranks of one distributed job share (torchrun starts every
    rank of a script under one name): the user means the job, as ``--job JOB`` names it."""

    job: str
    entries: tuple[RunEntry, ...]


@dataclass(frozen=True)
class Discover:
    """No TARGET: the only live run in ``directory`` (default: the runtime directory), a
    choice among several, or a wait for one to start: the caller decides which."""

    directory: Path | None = None


Target = LocalSocket | Recording | Remote | Job | Discover


# --- resolving ------------------------------------------------------------------------------


def resolve(text: str | None) -> Target:
    """What ``text`` names; TargetError with the reason when it can name no run.

    Only looks (the file system, the runtime directory's metadata); it never connects, never
    starts ssh and never waits.
    """
    if text is None:
        return Discover()
    if not text.strip():
        raise empty_error()
    if is_ssh_url(text):
        try:
            return Remote(parse_ssh_url(text))
        except SshUrlError as exc:
            raise TargetError(str(exc)) from None
    path = Path(text).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a directory on the way that we may not search, a loop, ...
        raise TargetError(f"cannot look at {text}: {exc.strerror or exc}") from None
    if mode is None:
        if os.sep not in text:  # a bare word: a run's name or pid in the runtime directory
            return _by_name(text)
        raise missing_error(text)
    if stat.S_ISDIR(mode):
        return only_run(path, text)
    if path.suffix == ".json":
        return _from_metadata(path, text)
    if stat.S_ISREG(mode):
        try:
            recording = is_recording(path)
        except OSError as exc:
            raise TargetError(f"cannot read {text}: {exc.strerror or exc}") from None
        if recording:
            return Recording(path)
        raise not_a_run_file_error(text)
    if stat.S_ISSOCK(mode):
        return LocalSocket(path, _entry_of(path))
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) else "a file"
    raise TargetError(f"{text} is {kind}, not a run's socket or a recording")


def only_run(directory: Path | None = None, text: str | None = None) -> LocalSocket:
    """The one live run in ``directory`` (default: the runtime directory); TargetError when
    there is none (``no_run``) or several (``several``). ``text`` is the directory as typed."""
    where = directory or runtime_dir()
    entries = discover(where)
    if len(entries) == 1:
        return LocalSocket(entries[0].socket, entries[0])
    shown = text if text is not None else str(where)
    if entries:
        raise several_error(f"in {shown}", entries)
    raise no_run_error(Path(shown))


def _from_metadata(path: Path, text: str) -> LocalSocket:
    try:
        meta = json.loads(path.read_text())
        socket = Path(meta["socket"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise bad_metadata_error(text, exc) from None
    return LocalSocket(socket, _entry_of(socket))


def _entry_of(socket: Path) -> RunEntry | None:
    """The live run whose socket this is, from the metadata beside it (None if none says so)."""
    for entry in discover(socket.parent, clean=False):
        if entry.socket == socket:
            return entry
    return None


def _by_name(text: str) -> LocalSocket | Job:
    if text.isdigit():
        found = [e for e in discover() if e.pid == int(text)]
    else:
        found = [e for e in discover() if e.name == text]
    if len(found) == 1:
        return LocalSocket(found[0].socket, found[0])
    jobs = {job_of(e) for e in found}
    if len(jobs) == 1 and None not in jobs:  # every run of that name is a rank of one job
        return Job(str(jobs.pop()), tuple(found))
    if found:  # unrelated runs, or ranks of several jobs: the user names one
        raise several_error(f"named {text}", found)
    raise missing_error(text)


def resolve_nodes(texts: Sequence[str], hint: str) -> list[SshTarget]:
    """Several TARGETs that must all be ``ssh://`` nodes (``tdbg-tui URL URL``, ``tdbg ls
    URL``), brace ranges expanded (``ssh://gpu{01..08}``); TargetError naming the first one that
    is not, ``hint`` saying why they must be. Every one is checked before any ssh starts."""
    from tdbg.connect.nodes import node_targets  # brace ranges and hostfiles live there

    return node_targets(texts, hint=hint)


# --- attaching ------------------------------------------------------------------------------


def attach(
    target: Target,
    opts: RemoteOptions | None = None,
    wait: float | None = None,
    text: str | None = None,
) -> ProbeClient:
    """A connected, handshaken client for a resolved target, for commands that need a live
    run. ``Discover`` waits up to ``wait`` seconds for the only local run; ``opts`` is for
    ``Remote``. Raises TargetError, or ConnectError (RemoteError over ssh) with one line.
    ``text`` is the TARGET as typed, for the error about a recording."""
    if isinstance(target, Recording):
        raise recording_error(text if text is not None else str(target.path))
    if isinstance(target, Job):  # a command that serves a job asks before attaching
        raise several_error(f"named {text or target.job}", target.entries)
    if isinstance(target, Remote):
        from tdbg.connect.ssh import RemoteOptions, connect  # the ssh machinery only when asked

        return connect(target.ssh, opts if opts is not None else RemoteOptions())
    if isinstance(target, Discover):
        return _wait_and_attach(target.directory, wait)
    return ProbeClient.connect(target.path)


def _wait_and_attach(directory: Path | None, wait: float | None) -> ProbeClient:
    """The only live run, waited for up to ``wait`` seconds, attached. Noted as waiting
    meanwhile (runtime.waiting_for_run), so that a run which ends before this process looks
    (a busy machine) serves on until it is attached: never missed. A run that goes away
    between being found and attached is waited past, not an error, until the deadline."""
    if not wait:
        return ProbeClient.connect(only_run(directory).path)
    deadline = time.monotonic() + wait
    with waiting_for_run(directory):
        while True:
            found = wait_for_run(directory, max(0.0, deadline - time.monotonic()))
            try:
                return ProbeClient.connect(found.path)
            except ConnectError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(POLL_INTERVAL)


def wait_for_run(directory: Path | None = None, wait: float | None = None) -> LocalSocket:
    """The only live run, waiting up to ``wait`` seconds for one to start (several: at once
    a TargetError naming them)."""
    deadline = time.monotonic() + (wait or 0.0)
    while True:
        try:
            return only_run(directory)
        except TargetError as exc:
            if exc.reason != "no_run" or time.monotonic() >= deadline:
                raise
        time.sleep(POLL_INTERVAL)
