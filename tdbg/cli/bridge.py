"""``tdbg bridge``: the remote end of ``ssh://`` targets — lists runs, or pumps bytes between
stdin/stdout and a probe's Unix socket; never parses a frame and never imports torch."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tdbg import __version__
from tdbg.cli.bridge_job import serve_job
from tdbg.connect.bridge_contract import (
    ERROR_PREFIX,
    EXIT_ERROR,
    EXIT_NO_RUN,
    EXIT_SEVERAL,
    exit_code,
)
from tdbg.connect.runtime import RunEntry, discover, runtime_dir
from tdbg.connect.target_errors import TargetError, recording_error, several_error
from tdbg.connect.targets import Job, LocalSocket, Recording, only_run, resolve
from tdbg.connect.waiting import wait_set
from tdbg.protocol.framing import PROTO_MAX, PROTO_MIN

CHUNK = 1 << 16
# Seconds the other direction may drain after one side closes: the bridge exits within 1 s
# (docs/guarantees.md, ssh).
LINGER = 0.8


class BridgeError(Exception):
    """A one-line reason, with the exit code that classifies it for the local side."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def add_bridge_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``tdbg bridge`` on the ``tdbg`` subcommand parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bridge",
        help="relay a run's socket over stdin/stdout (what ssh:// targets start remotely)",
        description="Relay a probe's Unix socket over stdin/stdout, as `tdbg dump ssh://host` "
        "and `tdbg-tui ssh://host` start it through ssh; or, with --list, print the live runs "
        "here as JSON.",
    )
    p.add_argument(
        "--socket",
        metavar="PATH",
        help="a run's socket, its .json metadata, or a runtime directory (default: the only "
        "run in the runtime directory)",
    )
    p.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help="where to look for runs (default: $TDBG_RUNTIME_DIR, else /tmp/tdbg-<uid>)",
    )
    p.add_argument("--list", action="store_true", help="print the live runs as one JSON object")
    p.add_argument(
        "--job",
        metavar="JOB",
        help="serve every rank of distributed job JOB here over the one stream (each rank a "
        "channel; ranks that start later join), as `tdbg-tui ssh://node1 ssh://node2` starts it",
    )
    p.add_argument(
        "--summaries",
        action="store_true",
        help="with --job: read the ranks here and send a summary of them twice a second; a "
        "rank's full stream only while the viewer asks for it (what tdbg-tui starts for a "
        "large job)",
    )
    p.set_defaults(func=cmd_bridge)
    return p


def cmd_bridge(args: argparse.Namespace, out: TextIO) -> int:
    try:
        if args.list:
            json.dump(listing(args.socket, args.runtime_dir), out, separators=(",", ":"))
            out.write("\n")
            out.flush()
            return 0
        if args.summaries and args.job is None:
            raise BridgeError("--summaries needs --job JOB")
        if args.job is not None:
            directory = job_directory(args.socket, args.runtime_dir)
            if args.summaries:
                from tdbg.cli.bridge_summary import serve_summaries  # numpy: only here

                return serve_summaries(args.job, directory, sys.stdin.fileno(), sys.stdout.fileno())
            return serve_job(args.job, directory, sys.stdin.fileno(), sys.stdout.fileno())
        path = choose_socket(args.socket, args.runtime_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            # Refused or gone: a dead run's socket, no run to reach (the local side may wait).
            gone = isinstance(exc, ConnectionRefusedError | FileNotFoundError)
            code = EXIT_NO_RUN if gone else EXIT_ERROR
            raise BridgeError(f"cannot connect to {path}: {exc.strerror or exc}", code) from None
        return pump(sock, sys.stdin.fileno(), sys.stdout.fileno())
    except BridgeError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        return exc.code


def _directory(runtime: str | None) -> Path:
    return Path(runtime).expanduser() if runtime else runtime_dir()


def _entries(path: str | None, runtime: str | None) -> tuple[Path, list[RunEntry]]:
    """The directory searched and the live runs in it (``path`` may name a directory)."""
    if path is not None and Path(path).expanduser().is_dir():
        directory = Path(path).expanduser()
    else:
        directory = _directory(runtime)
    return directory, discover(directory)


def job_directory(path: str | None, runtime: str | None) -> Path:
    """Where ``--job`` looks for ranks: ``--socket`` as a directory (or a run's socket or
    .json there: its directory), else the runtime directory."""
    if path is None:
        return _directory(runtime)
    where = Path(path).expanduser()
    if where.is_dir():
        return where
    if where.exists():
        return where.parent
    raise BridgeError(f"no such directory, socket or metadata file: {path}", EXIT_NO_RUN)


def _run_json(entry: RunEntry) -> dict[str, Any]:
    return dict(entry.meta, socket=str(entry.socket))


def listing(path: str | None, runtime: str | None) -> dict[str, Any]:
    """What ``--list`` prints: versions, where it looked, and every live run's metadata."""
    directory, entries = _entries(path, runtime)
    if path is not None and not Path(path).expanduser().is_dir():
        found = _resolve(path)
        if found.entry is None:
            raise BridgeError(f"no live tdbg run at {path}", EXIT_NO_RUN)
        entries = [found.entry]
    return {
        "tdbg": __version__,
        "protocol": [PROTO_MIN, PROTO_MAX],
        "host": socket.gethostname(),
        "runtime_dir": str(directory),
        "runs": [_run_json(e) for e in entries],
    }


def choose_socket(path: str | None, runtime: str | None) -> str:
    """The socket to relay: the one named, or the only live run (BridgeError otherwise)."""
    if path is None:
        try:
            return str(only_run(_directory(runtime)).path)
        except TargetError as exc:
            raise BridgeError(str(exc), exit_code(exc.reason)) from None
    return str(_resolve(path).path)


def _resolve(path: str) -> LocalSocket:
    """The run ``--socket PATH`` names here (a socket, .json, directory, name or pid)."""
    try:
        found = resolve(path)
    except TargetError as exc:
        raise BridgeError(str(exc), exit_code(exc.reason)) from None
    if isinstance(found, Recording):
        raise BridgeError(str(recording_error(path)))
    if isinstance(found, Job):  # one socket is relayed: the ssh side names a rank
        raise BridgeError(str(several_error(f"named {path}", found.entries)), EXIT_SEVERAL)
    if not isinstance(found, LocalSocket):  # an ssh:// URL inside the URL's path
        raise BridgeError(f"{path} names no run's socket on this host")
    return found


def pump(sock: socket.socket, infd: int, outfd: int) -> int:
    """Copy bytes both ways until one side closes, then let the other drain for LINGER s.

    A blocking thread per direction, so a stalled reader on one side never holds up the other.
    EOF on one side is passed on as a half-close (shutdown of the socket's write side, or
    closing our stdout), and the bridge exits at most LINGER s later whatever the other side
    does: that is what lets ssh and the probe both notice a departed peer at once.
    """
    done = threading.Event()

    def upstream() -> None:  # stdin -> socket
        try:
            while True:
                data = os.read(infd, CHUNK)
                if not data:
                    break
                sock.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            done.set()

    def downstream() -> None:  # socket -> stdout
        try:
            while True:
                data = sock.recv(CHUNK)
                if not data:
                    break
                view = memoryview(data)
                while view:
                    view = view[os.write(outfd, view) :]
        except OSError:
            pass
        finally:
            _close_output(outfd)
            done.set()

    threads = [
        threading.Thread(target=upstream, name="bridge-up", daemon=True),
        threading.Thread(target=downstream, name="bridge-down", daemon=True),
    ]
    for thread in threads:
        thread.start()
    wait_set(done)
    deadline = time.monotonic() + LINGER
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    # A thread may still block in read(): it is a daemon and does not hold the exit up.
    return 0


def _close_output(fd: int) -> None:
    """Signal EOF on our stdout: half-close it when it is a socket (sshd may hand us one
    socketpair for stdin and stdout), then point the fd at /dev/null so late flushes are
    harmless."""
    try:
        copy = os.dup(fd)
    except OSError:
        return  # already closed
    try:
        dup: socket.socket | None = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        dup = None  # a pipe: replacing the fd below closes it, which is the EOF
    if dup is not None:
        try:
            dup.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        dup.close()
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass
