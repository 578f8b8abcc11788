"""Which run a command's TARGET argument names, and the one-line error when it names none.

A TARGET is a socket path, a run's ``.json``, a runtime directory, or ``ssh://`` (reached with
the system ssh and ``tdbg bridge`` on the remote host, see tdbg/remote.py).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from tdbg.connect.client import ProbeClient, resolve_target
from tdbg.connect.runtime import discover, runtime_dir
from tdbg.connect.sshurl import SshTarget, SshUrlError, is_ssh_url, parse_ssh_url
from tdbg.recording.reader import is_file_target, is_recording

if TYPE_CHECKING:
    from tdbg.connect.ssh import RemoteOptions

TARGET_HELP = "socket path, run .json, directory, or ssh://[user@]host[:port][/path]"


class CliError(Exception):
    """A one-line error for the user; exit code 2."""


def target_arg(text: str) -> str:
    """argparse type of a TARGET: an empty one is a usage error, not a search for ''."""
    if not text.strip():
        raise argparse.ArgumentTypeError("TARGET is empty")
    return text


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


def ssh_target(text: str) -> SshTarget:
    """Parse an ``ssh://`` TARGET (CliError with the reason)."""
    try:
        return parse_ssh_url(text)
    except SshUrlError as exc:
        raise CliError(str(exc)) from None


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    """``-o OPTION`` (repeatable) and ``--remote-tdbg PATH`` for commands taking a TARGET."""
    group = parser.add_argument_group("ssh:// targets")
    group.add_argument(
        "-o",
        dest="ssh_options",
        action="append",
        default=[],
        metavar="OPTION",
        help="an ssh option, as ssh spells it (-o ProxyJump=gw); repeatable",
    )
    group.add_argument(
        "--remote-tdbg",
        default="tdbg",
        metavar="PATH",
        help="the tdbg to run on the remote host (default: tdbg on the remote PATH)",
    )


def remote_options(args: argparse.Namespace) -> RemoteOptions:
    """The RemoteOptions that ``add_remote_options`` parsed (imported only for ssh targets)."""
    from tdbg.connect.ssh import RemoteOptions

    return RemoteOptions(
        options=tuple(getattr(args, "ssh_options", None) or ()),
        remote_tdbg=getattr(args, "remote_tdbg", None) or "tdbg",
    )


def connect_target(
    target: str | None, wait: float | None, args: argparse.Namespace | None = None
) -> ProbeClient:
    """A connected, handshaken client for TARGET: a local run, or one reached over ssh.

    ``args`` carries ``-o`` / ``--remote-tdbg`` for ssh targets. Raises CliError or
    ConnectError (RemoteError for ssh) with a one-line reason.
    """
    if target is not None and is_file_target(target):
        if is_recording(os.path.expanduser(target)):
            raise CliError(
                f"{target} is a recording: a recording cannot run commands "
                "(tdbg dump and tdbg-tui replay read it)"
            )
        raise CliError(f"{target} is a file, neither a probe's socket nor a tdbg recording")
    if target is not None and is_ssh_url(target):
        from tdbg.connect.ssh import connect

        remote = ssh_target(target)
        opts = remote_options(args) if args is not None else remote_options(argparse.Namespace())
        return connect(remote, opts)
    return ProbeClient.connect(pick_target(target, wait))
