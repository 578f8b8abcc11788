"""The local end of ``ssh://`` targets: run the system ssh with ``tdbg bridge`` on the remote
host, speak the protocol through it, and turn ssh's failures into one-line errors."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from tdbg import __version__
from tdbg.connect.bridge_contract import ERROR_PREFIX, EXIT_NO_RUN, EXIT_SEVERAL
from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.sshurl import SshTarget
from tdbg.protocol.framing import MAGIC, PREAMBLE, PREAMBLE_SIZE, PROTO_MAX, PROTO_MIN

CONNECT_TIMEOUT = 30  # ssh's ConnectTimeout (guarantees: ssh), seconds
SERVER_ALIVE_INTERVAL = 15  # ssh probes a silent server this often (seconds) ...
SERVER_ALIVE_COUNT_MAX = 3  # ... and gives up after this many unanswered probes
HANDSHAKE_TIMEOUT = 60.0  # connect + authenticate + start the remote tdbg + the probe's hello
LIST_TIMEOUT = 60.0
TERM_GRACE = 3.0  # SIGTERM, then SIGKILL after this long (guarantees: ssh)
EXIT_GRACE = 0.5  # after our EOF, ssh usually exits by itself this fast
STDERR_LINES = 50  # ssh's last stderr lines kept for the error message
PR_SET_PDEATHSIG = 1


class RemoteError(ConnectError):
    """Reaching a run over ssh failed; ``str()`` is one line for the user (exit code 2).

    ``no_run``: the host was reached and the bridge found no run to attach to there (it exited
    with EXIT_NO_RUN), as opposed to ssh or the network failing.
    """

    def __init__(self, message: str, no_run: bool = False) -> None:
        super().__init__(message)
        self.no_run = no_run


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach remote runs: extra ``ssh -o`` options and the remote ``tdbg`` to start."""

    options: tuple[str, ...] = ()
    remote_tdbg: str = "tdbg"
    ssh: str = "ssh"

    def __post_init__(self) -> None:
        for option in self.options:
            if not option or any(ord(c) < 0x20 or ord(c) == 0x7F for c in option):
                raise RemoteError(f"invalid ssh option {option!r}")
        if not self.remote_tdbg or any(ord(c) < 0x20 for c in self.remote_tdbg):
            raise RemoteError(f"invalid --remote-tdbg {self.remote_tdbg!r}")


def remote_command(remote_tdbg: str, args: Sequence[str]) -> list[str]:
    """The remote command line's words, each POSIX-quoted for the remote shell (guarantees: ssh).

    A leading ``~/`` in the remote tdbg stays unquoted as ``"$HOME"/`` so that
    ``--remote-tdbg '~/venv/bin/tdbg'`` means the remote user's home, as with rsync.
    """
    if remote_tdbg.startswith("~/"):
        first = '"$HOME"/' + shlex.quote(remote_tdbg[2:])
    else:
        first = shlex.quote(remote_tdbg)
    return [first, *(shlex.quote(a) for a in args)]


def ssh_argv(target: SshTarget, opts: RemoteOptions, args: Sequence[str]) -> list[str]:
    """``ssh -T [-o ...] -o ConnectTimeout=30 -o ServerAlive... [-p port] [-l user] -- host
    <remote tdbg> ARGS``.

    The contract writes ``-o ConnectTimeout=30`` before the user's options; it comes after them here
    because ssh keeps the first value it sees for an option, so this order lets a user's
    ``-o ConnectTimeout=...`` (or ServerAlive...) win over our defaults. The ServerAlive
    options make ssh notice a network that went silent (no RST, no FIN) within about 45 s
    and exit, which is what shows "reconnecting"; without them a dead link looks idle forever.
    """
    argv = [opts.ssh, "-T"]
    for option in opts.options:
        argv += ["-o", option]
    argv += [
        "-o",
        f"ConnectTimeout={CONNECT_TIMEOUT}",
        "-o",
        f"ServerAliveInterval={SERVER_ALIVE_INTERVAL}",
        "-o",
        f"ServerAliveCountMax={SERVER_ALIVE_COUNT_MAX}",
    ]
    if target.port is not None:
        argv += ["-p", str(target.port)]
    if target.user:
        argv += ["-l", target.user]
    return [*argv, "--", target.host, *remote_command(opts.remote_tdbg, args)]


def bridge_args(target: SshTarget, listing: bool = False) -> list[str]:
    args = ["bridge"]
    if listing:
        args.append("--list")
    if target.path:
        args += ["--socket", target.path]
    return args


def _pdeathsig() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL ssh when the thread that spawned it dies.

    subprocess has no other way to set PR_SET_PDEATHSIG (posix_spawn has no attribute for
    it either, and a wrapper such as ``setpriv --pdeathsig`` is not everywhere), so this is
    the one preexec_fn in tdbg, despite the warning about preexec_fn and threads. What makes
    that warning bite is code in the child that takes a lock another thread held at fork
    time (an import, logging, a C library's mutex). Here everything is resolved before fork
    (the libc handle, the function, its argument types, the signal number), so the child runs
    a closure that makes one call of prctl(2), a plain async-signal-safe system call, then
    execs: no import, no lock, no I/O.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    kill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)

    return preexec


class SshProcess:
    """A running ssh: its Popen, the last lines of its stderr, and an orderly stop."""

    def __init__(
        self,
        target: SshTarget,
        opts: RemoteOptions,
        args: Sequence[str],
        stdin: int | None,
        stdout: int | None,
        group: SshGroup | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        """``argv``: run this instead of ssh (a node's bridge started here, for a local job
        read through the same node stream as a remote one)."""
        self.target = target
        self.opts = opts
        self.argv = list(argv) if argv is not None else ssh_argv(target, opts, args)
        self.lines: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._stopping = False
        self._reaper: threading.Thread | None = None
        if group is not None and group.stopped:
            raise RemoteError(f"stopped before ssh to {target.node} started")
        try:
            # Its own session: a Ctrl-C in our terminal is ours to handle, and stopping
            # ssh's process group cannot touch ours.
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=subprocess.PIPE if stdout is None else stdout,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_pdeathsig(),  # one prctl(2) in the child, see _pdeathsig
            )
        except FileNotFoundError:
            raise RemoteError(
                f"ssh not found ({opts.ssh!r} is not on PATH): install the OpenSSH client"
            ) from None
        except OSError as exc:
            raise RemoteError(f"cannot start {opts.ssh}: {exc.strerror or exc}") from None
        assert self.proc.stderr is not None
        # ssh's stderr is read all along, so a chatty ssh never blocks on a full pipe.
        self._reader = threading.Thread(
            target=self._read_stderr, args=(self.proc.stderr,), name="tdbg-ssh-stderr", daemon=True
        )
        self._reader.start()
        if group is not None:
            group.add(self)  # stops this ssh at once if the group was stopped meanwhile

    def _read_stderr(self, stream: IO[bytes]) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()
                if line:
                    self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finished(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for ssh to exit; its status, or None while it runs."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(1.0)  # the rest of its stderr
        return rc

    def failure(self, wait: float = 5.0) -> RemoteError:
        """Why this ssh failed, once it has exited (stopping it if it has not)."""
        rc = self.finished(wait)
        if rc is None:
            self.stop(wait=True)
            rc = self.proc.returncode
        message = classify(self.target, self.opts, rc, list(self.lines))
        return RemoteError(message, no_run=rc == EXIT_NO_RUN)

    def stop(self, wait: bool = False, now: bool = False) -> None:
        """Let ssh exit on its own briefly, then SIGTERM, then SIGKILL after 3 s; with
        ``now``, SIGTERM at once (nobody waits for an answer any more).

        With ``wait=False`` this happens on a daemon thread, so a UI never freezes on it; if
        the process exits first, PR_SET_PDEATHSIG still ends ssh.
        """
        if self._stopping:
            return
        self._stopping = True
        if wait:
            self._stop(now)
        else:
            self._reaper = threading.Thread(
                target=self._stop, args=(now,), name="tdbg-ssh-reaper", daemon=True
            )
            self._reaper.start()

    def _stop(self, now: bool = False) -> None:
        steps = ((None, EXIT_GRACE), (signal.SIGTERM, TERM_GRACE))
        for sig, grace in steps[1:] if now else steps:
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
            if self.finished(grace) is not None:
                return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class SshGroup:
    """The ssh processes started for one caller, so that all of them can be stopped at once
    (Ctrl-C, or the UI closing) rather than each running until it answers or times out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[SshProcess] = set()
        self.stopped = False

    def add(self, ssh: SshProcess) -> None:
        with self._lock:
            if not self.stopped:
                self._running = {s for s in self._running if s.proc.poll() is None}
                self._running.add(ssh)
                return
        ssh.stop(now=True)

    def discard(self, ssh: SshProcess) -> None:
        with self._lock:
            self._running.discard(ssh)

    def stop(self, wait: float = 0.0) -> None:
        """SIGTERM every ssh of the group now (SIGKILL 3 s later), and refuse new ones; wait up
        to ``wait`` s for them to exit."""
        with self._lock:
            self.stopped = True
            running, self._running = list(self._running), set()
        for ssh in running:
            ssh.stop(now=True)
        deadline = time.monotonic() + wait
        for ssh in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ssh.proc.wait(max(0.0, deadline - time.monotonic()))


def classify(target: SshTarget, opts: RemoteOptions, rc: int | None, lines: list[str]) -> str:
    """One line saying why ``ssh ... tdbg bridge`` failed, from its exit status and stderr."""
    node = target.node
    text = "\n".join(lines)
    said = next((ln for ln in reversed(lines) if not ln.startswith("Warning:")), "")
    for line in reversed(lines):
        if line.startswith(ERROR_PREFIX):
            message = line[len(ERROR_PREFIX) :]
            if rc == EXIT_SEVERAL:
                return (
                    f"several runs on {node}: {message}; pick one with {target.url('/SOCKET-PATH')}"
                )
            if rc == EXIT_NO_RUN:
                return f"no tdbg run on {node}: {message}"
            return f"{node}: {message}"
    remote_tdbg = opts.remote_tdbg
    if rc == 127 or "command not found" in text or f"{remote_tdbg}: not found" in text:
        return (
            f"tdbg not found on {node} ({remote_tdbg!r}: a non-interactive ssh session's PATH "
            "often lacks your venv or conda env): install tdbg there (pip install tdbg) or "
            "name it with --remote-tdbg PATH"
        )
    if rc == 126:
        return f"{remote_tdbg!r} on {node} is not executable ({said}); check --remote-tdbg PATH"
    for needles, template in SSH_FAILURES:
        if any(needle in text for needle in needles):
            return template.format(node=node, said=said, host=target.host, version=__version__)
    if rc == 255:
        return f"ssh to {node} failed: {said or 'no message'}"
    if rc is not None and rc < 0:
        return f"ssh to {node} was killed by signal {-rc}"
    return f"tdbg bridge on {node} exited with status {rc}" + (f": {said}" if said else "")


# What ssh (or the remote tdbg) said -> what the user is told; the first match wins. Templates
# may name {node}, {said} (ssh's own words), {host} and {version} (this tdbg's).
SSH_FAILURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("unrecognized arguments: --job",),
        "the tdbg on {node} is too old to serve a job's ranks (tdbg bridge --job): "
        "upgrade it to {version}",
    ),
    (
        ("invalid choice: 'bridge'",),
        "the tdbg on {node} is too old to have `tdbg bridge`: upgrade it to {version}",
    ),
    (
        ("Host key verification failed", "IDENTIFICATION HAS CHANGED"),
        "host key verification failed for {node}: check known_hosts (ssh said: {said})",
    ),
    (
        ("Permission denied", "Too many authentication failures"),
        "authentication failed for {node}: check your key or agent (ssh said: {said})",
    ),
    (("Could not resolve hostname",), "could not resolve host {host!r}"),
    (
        ("Connection refused",),
        "connection refused by {node}: is sshd running, and is the port right?",
    ),
    (("timed out",), "host unreachable: connection to {node} timed out"),
    (("No route to host", "Network is unreachable"), "host unreachable: {node} ({said})"),
    (("Connection closed", "Connection reset"), "ssh connection to {node} closed ({said})"),
)


class SshProbeClient(ProbeClient):
    """A ProbeClient whose socket is one end of a socketpair pumped by ssh; closing it also
    stops ssh."""

    ssh: SshProcess
    target: SshTarget

    def close(self) -> None:
        super().close()
        ssh = getattr(self, "ssh", None)
        if ssh is not None:
            ssh.stop()


def peek_preamble(
    sock: socket.socket, ssh: SshProcess, timeout: float, magic: bytes = MAGIC
) -> tuple[int, int]:
    """Wait until the probe's preamble has arrived (left in the socket for the handshake).

    Everything before it is the transport's business: EOF here means ssh or the bridge
    failed, and ssh's exit status and stderr say why. The socket's timeout is put back as
    it was: the short slices used here must not outlive the peek (on a link slower than a
    slice, the handshake's reads would time out).
    """
    before = sock.gettimeout()
    try:
        return _peek_preamble_sliced(sock, ssh, timeout, magic)
    finally:
        sock.settimeout(before)


def _peek_preamble_sliced(
    sock: socket.socket, ssh: SshProcess, timeout: float, magic: bytes
) -> tuple[int, int]:
    what = "a tdbg probe" if magic == MAGIC else "a tdbg bridge"
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            said = ssh.lines[-1] if ssh.lines else "no message from ssh"
            ssh.stop(wait=True)
            raise RemoteError(
                f"no answer from {what} through ssh to {ssh.target.node} within "
                f"{timeout:g} s ({said})"
            )
        sock.settimeout(min(left, 0.25))
        try:
            data = sock.recv(PREAMBLE_SIZE, socket.MSG_PEEK)
        except TimeoutError:
            continue
        except OSError:
            data = b""
        if not data:
            raise ssh.failure()
        if len(data) < PREAMBLE_SIZE:
            if not magic.startswith(data[:4]):
                break
            time.sleep(0.005)  # the rest of 8 bytes is in flight
            continue
        got, lo, hi = PREAMBLE.unpack(data)
        if got != magic:
            break
        return lo, hi
    ssh.stop(wait=True)
    raise RemoteError(
        f"{ssh.target.node}: the remote end is not {what} (did {ssh.opts.remote_tdbg!r} "
        "print something on stdout?)"
    )


def connect(
    target: SshTarget,
    opts: RemoteOptions,
    timeout: float = HANDSHAKE_TIMEOUT,
    group: SshGroup | None = None,
) -> SshProbeClient:
    """Start ``ssh host tdbg bridge [--socket PATH]`` and handshake with the probe through it.

    While it connects, ``group.stop()`` ends it; once connected, the client owns its ssh.
    """
    ours, theirs = socket.socketpair()
    try:
        ssh = SshProcess(target, opts, bridge_args(target), theirs.fileno(), theirs.fileno(), group)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()  # ssh has its copy; ours must go, so ssh's exit reads as EOF here
    try:
        lo, hi = peek_preamble(ours, ssh, timeout)
        if min(hi, PROTO_MAX) < max(lo, PROTO_MIN):
            ssh.stop()
            raise RemoteError(
                f"protocol version mismatch: the run on {target.node} speaks tdbg protocol "
                f"{_span(lo, hi)}, this tdbg {__version__} speaks {_span(PROTO_MIN, PROTO_MAX)}"
                "; install the same tdbg version on both ends"
            )
        client = SshProbeClient.handshake(ours, target.url(), max(1.0, timeout))
    except ConnectError as exc:
        ours.close()
        ssh.stop()
        if isinstance(exc, RemoteError):
            raise
        raise RemoteError(str(exc)) from None
    except BaseException:
        ours.close()
        ssh.stop()
        raise
    assert isinstance(client, SshProbeClient)  # handshake() builds cls
    if group is not None:
        group.discard(ssh)  # closing the client stops it, gently (EOF first)
    client.ssh = ssh
    client.target = target
    client.run.setdefault("node", target.node)
    return client


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass
class RemoteListing:
    """What ``tdbg bridge --list`` answered on one node."""

    target: SshTarget
    tdbg: str
    protocol: tuple[int, int]
    host: str
    runtime_dir: str
    runs: list[dict[str, Any]] = field(default_factory=list)


def list_runs(
    target: SshTarget,
    opts: RemoteOptions,
    timeout: float = LIST_TIMEOUT,
    group: SshGroup | None = None,
) -> RemoteListing:
    """Remote discovery: ``ssh host tdbg bridge --list`` (RemoteError with the reason);
    ``group.stop()`` ends it early."""
    ssh = SshProcess(target, opts, bridge_args(target, listing=True), None, None, group)
    assert ssh.proc.stdout is not None
    with ssh.proc.stdout:
        out = _read_all(ssh.proc.stdout.fileno(), time.monotonic() + timeout)
    rc = ssh.finished(5.0) if out is not None else None
    if rc is None:
        ssh.stop(wait=True)
        raise RemoteError(
            f"no answer from tdbg bridge --list on {target.node} within {timeout:g} s"
        )
    if rc != 0 or out is None:
        raise RemoteError(classify(target, opts, rc, list(ssh.lines)), no_run=rc == EXIT_NO_RUN)
    # Login scripts may print on stdout: the answer is the last line that is a JSON object.
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
                return RemoteListing(
                    target=target,
                    tdbg=str(data["tdbg"]),
                    protocol=(int(data["protocol"][0]), int(data["protocol"][1])),
                    host=str(data.get("host") or target.host),
                    runtime_dir=str(data.get("runtime_dir") or ""),
                    runs=[dict(r) for r in data["runs"] if isinstance(r, dict)],
                )
            except (ValueError, KeyError, TypeError, IndexError):
                break
    raise RemoteError(f"{target.node}: unexpected answer from tdbg bridge --list")


def _read_all(fd: int, deadline: float) -> bytes | None:
    """Everything until EOF on ``fd``; None when ``deadline`` passes first."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 1 << 16)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def run_speaks_our_protocol(run: dict[str, Any]) -> bool:
    """Whether a listed run's protocol range (from its metadata) overlaps ours."""
    try:
        lo, hi = int(run.get("proto_min", PROTO_MIN)), int(run.get("proto_max", PROTO_MAX))
    except (TypeError, ValueError):
        return False
    return min(hi, PROTO_MAX) >= max(lo, PROTO_MIN)
