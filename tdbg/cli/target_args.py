"""The TARGET argument of the CLI's commands: its argparse type and help, the ssh options that go
with it, and attaching to what it names (the resolving itself is tdbg.connect.targets')."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tdbg.connect.client import ProbeClient
from tdbg.connect.target_errors import empty_error
from tdbg.connect.targets import TARGET_HELP, Remote, Target, attach, resolve

if TYPE_CHECKING:
    from tdbg.connect.ssh import RemoteOptions

__all__ = [
    "TARGET_HELP",
    "add_remote_options",
    "attach_target",
    "connect_target",
    "remote_options",
    "target_arg",
]


def target_arg(text: str) -> str:
    """argparse type of a TARGET: an empty one is a usage error, not a search for ''."""
    if not text.strip():
        raise argparse.ArgumentTypeError(str(empty_error()))
    return text


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


def connect_target(text: str | None, wait: float | None, args: argparse.Namespace) -> ProbeClient:
    """A connected, handshaken client for the live run TARGET names, waiting up to ``wait`` s
    for the only local run when it names none. Raises TargetError or ConnectError (RemoteError
    over ssh) with a one-line reason; a recording is refused (it cannot run commands)."""
    return attach_target(resolve(text), text, wait, args)


def attach_target(
    target: Target, text: str | None, wait: float | None, args: argparse.Namespace
) -> ProbeClient:
    """``connect_target`` for a TARGET already resolved (``text`` is as the user typed it)."""
    opts = remote_options(args) if isinstance(target, Remote) else None  # ssh only when asked
    return attach(target, opts, wait, text)
