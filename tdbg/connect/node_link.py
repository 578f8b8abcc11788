"""One ssh connection to a node carrying every rank of a job there: ``tdbg bridge --job JOB``.

``NodeLink.open`` starts ``ssh node tdbg bridge --job JOB [--socket DIR]`` and reads the node's
hello; each rank the bridge reaches then arrives as a ``Channel``: a run's metadata and one end
of a local socketpair whose other end this link pumps to and from the rank's channel of the
node stream. A ``ProbeClient`` handshakes over that socket as over a rank's own Unix socket, so
reading and sending commands work unchanged, and every rank of the node shares the one ssh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tdbg.connect.jobs import SCALE_FROM, job_size
from tdbg.connect.runtime import discover, runtime_dir
from tdbg.connect.ssh import (
    HANDSHAKE_TIMEOUT,
    RemoteError,
    RemoteOptions,
    SshGroup,
    SshProcess,
    peek_preamble,
)
from tdbg.connect.sshurl import SshTarget
from tdbg.protocol.framing import (
    NODE_MAGIC,
    NODE_MAX_FRAME,
    NODE_VERSION,
    Decoder,
    ProtocolError,
    pack,
)
from tdbg.protocol.messages import (
    NodeHello,
    NodeMessage,
    channel_close,
    channel_data,
    read_node_message,
)
from tdbg.protocol.messages.node_summary import NodeSummary, subscribe, with_windows_of

CHUNK = 1 << 16  # bytes a channel's data frame carries at most


def hang_up(sockets: Iterable[socket.socket]) -> None:
    """End each of a node stream's channel sockets: shut both ways first, so a thread blocked
    reading one wakes with EOF, then close it. Both ends of the stream (this link and the
    remote `tdbg bridge --job`) end their channels so."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


@dataclass
class Channel:
    """A rank reached through a node link: its run metadata and our end of its socket."""

    ch: int
    run: dict[str, Any]
    sock: socket.socket
    node: SshTarget


# How this machine runs tdbg for a local job's own bridge (no ssh).
LOCAL_TDBG = (sys.executable, "-m", "tdbg.cli")


def local_target(directory: Path | None = None) -> SshTarget:
    """This machine as a node whose ranks are in ``directory`` (the runtime directory)."""
    return SshTarget(host=socket.gethostname(), path=str(directory or runtime_dir()))


@dataclass
class Spawned:
    """A node's bridge started, its hello not read yet: our end of its stream and its process."""

    sock: socket.socket
    ssh: SshProcess

    def close(self) -> None:
        self.sock.close()
        self.ssh.stop()


def spawn_bridge(
    target: SshTarget,
    opts: RemoteOptions,
    job: str,
    group: SshGroup | None = None,
    summaries: bool = False,
    local: Sequence[str] | None = None,
) -> Spawned:
    """Start ``target``'s ``tdbg bridge --job`` (over ssh, or here with ``local``)."""
    ours, theirs = socket.socketpair()
    args = job_bridge_args(target, job, summaries)
    argv = None if local is None else [*local, *args]
    try:
        ssh = SshProcess(target, opts, args, theirs.fileno(), theirs.fileno(), group, argv)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Spawned(ours, ssh)


def spawn_local_bridge(job: str, directory: Path | None = None) -> Spawned | None:
    """This machine's bridge for local job ``job`` when the job is read through summaries (more
    than SCALE_FROM ranks), started at once: ``tdbg-tui --job`` starts it before its own
    imports (~1 s on a busy 2-core machine), so the two start side by side. None otherwise."""
    if job_size(discover(directory), job) <= SCALE_FROM:
        return None
    with contextlib.suppress(RemoteError):
        return spawn_bridge(local_target(directory), RemoteOptions(), job, None, True, LOCAL_TDBG)
    return None


def job_bridge_args(target: SshTarget, job: str, summaries: bool = False) -> list[str]:
    args = ["bridge", "--job", job]
    if target.path:
        args += ["--socket", target.path]
    if summaries:
        args.append("--summaries")
    return args


class NodeLink:
    """A live ``tdbg bridge --job`` on one node. ``channels()`` yields its ranks as they come;
    it ends when the link does (``reason`` then says why)."""

    def __init__(self, target: SshTarget, ssh: SshProcess, sock: socket.socket) -> None:
        self.target = target
        self.ssh = ssh
        self.sock = sock
        self.hello: NodeHello | None = None
        self.reason: str | None = None  # why the link ended
        self.notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._opened: queue.SimpleQueue[Channel | None] = queue.SimpleQueue()
        self._channels: dict[int, socket.socket] = {}  # ch -> the pump's end of its socketpair
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False
        # --summaries: the node's newest summary, taken by the consumer (latest wins: a
        # summary says everything an older one said, but the windows it carries on).
        self._summary: NodeSummary | None = None
        self.summaries = 0  # received
        self._layer_names: tuple[str, tuple[str, ...]] | None = None  # (layout, its names)

    @classmethod
    def open(
        cls,
        target: SshTarget,
        opts: RemoteOptions,
        job: str,
        timeout: float = HANDSHAKE_TIMEOUT,
        group: SshGroup | None = None,
        summaries: bool = False,
        local: Sequence[str] | None = None,
        spawned: Spawned | None = None,
    ) -> NodeLink:
        """Start the node's bridge and read its hello; RemoteError with one line otherwise.
        ``summaries``: the bridge sends node summaries, and a rank's stream on ``subscribe``
        only. ``local``: the command that runs ``tdbg`` here (no ssh: this machine's ranks).
        ``spawned``: the bridge, already started (``spawn_bridge``)."""
        if spawned is None:
            spawned = spawn_bridge(target, opts, job, group, summaries, local)
        ours, ssh = spawned.sock, spawned.ssh
        link = cls(target, ssh, ours)
        try:
            lo, hi = peek_preamble(ours, ssh, timeout, NODE_MAGIC)
            if not lo <= NODE_VERSION <= hi:
                raise RemoteError(
                    f"{target.node}: its tdbg bridge speaks node stream {lo}-{hi}, this tdbg "
                    f"{NODE_VERSION}; install the same tdbg version on every node"
                )
            decoder = Decoder(NODE_MAX_FRAME, magic=NODE_MAGIC)
            pending = link._read_hello(decoder, time.monotonic() + timeout)
        except BaseException:
            ours.close()
            ssh.stop()
            raise
        if group is not None:
            group.discard(ssh)  # closing the link stops it
        threading.Thread(
            target=link._read, args=(decoder, pending), name="tdbg-node", daemon=True
        ).start()
        return link

    def _read_hello(self, decoder: Decoder, deadline: float) -> list[Any]:
        """Read until the node's hello; what came after it in the same chunk is returned."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(f"{self.target.node}: no hello from tdbg bridge --job in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(CHUNK)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                raise self.ssh.failure()
            try:
                messages = decoder.feed(chunk)
            except ProtocolError as exc:
                raise RemoteError(f"{self.target.node}: bad node stream ({exc})") from None
            if messages:
                first = read_node_message(messages[0])
                if first is None or first["type"] != "node":
                    raise RemoteError(f"{self.target.node}: the bridge did not say hello")
                self.hello = first
                self.sock.settimeout(None)
                return messages[1:]

    @property
    def version(self) -> str:
        return self.hello["tdbg"] if self.hello is not None else "?"

    # --- the node stream -> channels --------------------------------------------------------
    def _read(self, decoder: Decoder, pending: list[Any]) -> None:
        try:
            for raw in pending:
                self._dispatch_raw(raw)
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    break
                for raw in decoder.feed(chunk):
                    self._dispatch_raw(raw)
        except (OSError, ProtocolError) as exc:
            self.reason = f"connection lost: {exc}"
        finally:
            if self.reason is None:
                failure = self.ssh.failure(wait=1.0) if not self._closed else None
                self.reason = f"connection lost: {failure}" if failure else "closed"
            self._end_channels()
            self._opened.put(None)

    def _dispatch_raw(self, raw: Any) -> None:
        if isinstance(raw, dict) and raw.get("type") == "summary":
            summary = NodeSummary.from_wire(raw)
            if summary is not None:
                summary = self._named(summary)
                with self._lock:
                    if self._summary is not None:  # not taken yet: its windows carried on
                        summary = with_windows_of(self._summary, summary)
                    self._summary = summary
                    self.summaries += 1
            return
        self._dispatch(read_node_message(raw))

    def _named(self, summary: NodeSummary) -> NodeSummary:
        """``summary`` with its layers' names: the bridge sends them once per layout, and an
        untaken summary is replaced by the next, so the link keeps them and adds them back."""
        grads = summary.grads
        if grads is None:
            return summary
        if grads.names is not None:
            self._layer_names = (grads.layout, grads.names)
            return summary
        if self._layer_names is not None and self._layer_names[0] == grads.layout:
            return dataclasses.replace(
                summary, grads=dataclasses.replace(grads, names=self._layer_names[1])
            )
        return summary

    def take_summary(self) -> NodeSummary | None:
        """The newest summary not taken yet, or None."""
        with self._lock:
            summary, self._summary = self._summary, None
        return summary

    def subscribe(self, rank: int) -> None:
        """Ask the bridge for rank ``rank``'s full stream: it arrives as a new channel."""
        self._send(subscribe(rank))

    def _dispatch(self, message: NodeMessage | None) -> None:
        if message is None:
            return
        if message["type"] == "open":
            mine, theirs = socket.socketpair()
            with self._lock:
                self._channels[message["ch"]] = mine
            threading.Thread(
                target=self._upstream,
                args=(message["ch"], mine),
                name=f"tdbg-node-ch{message['ch']}",
                daemon=True,
            ).start()
            self._opened.put(Channel(message["ch"], message["run"], theirs, self.target))
        elif message["type"] == "data":
            with self._lock:
                known = self._channels.get(message["ch"])
            if known is not None:
                try:
                    known.sendall(message["data"])
                except OSError:  # the reader of that rank left: tell the bridge
                    self._drop(message["ch"])
        elif message["type"] == "close":
            with self._lock:
                known = self._channels.pop(message["ch"], None)
            if known is not None:
                with contextlib.suppress(OSError):
                    known.shutdown(socket.SHUT_WR)  # the rank's reader sees EOF
        elif message["type"] == "notice":
            self.notices.put(message["message"])

    def _upstream(self, ch: int, mine: socket.socket) -> None:
        """What the rank's client writes (hello, commands, bye) goes to its channel."""
        try:
            while True:
                data = mine.recv(CHUNK)
                if not data:
                    break
                self._send(channel_data(ch, data))
        except OSError:
            pass
        self._drop(ch)
        with contextlib.suppress(OSError):
            mine.close()

    def _drop(self, ch: int) -> None:
        with self._lock:
            mine = self._channels.pop(ch, None)
        if mine is None:
            return
        with contextlib.suppress(OSError):
            self._send(channel_close(ch, "client left"))
        with contextlib.suppress(OSError):
            mine.close()

    def _send(self, message: Any) -> None:
        frame = pack(message, NODE_MAX_FRAME)
        with self._write_lock:
            self.sock.sendall(frame)

    def _end_channels(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        hang_up(channels)

    # --- the consumer's side ----------------------------------------------------------------
    def channels(self, stop: threading.Event) -> Iterator[Channel]:
        """Each rank as the bridge reaches it, until the link ends or ``stop`` is set."""
        while not stop.is_set():
            try:
                channel = self._opened.get(timeout=0.25)
            except queue.Empty:
                continue
            if channel is None:
                return
            yield channel

    def close(self) -> None:
        """End the link: its channels see EOF, the bridge sees our EOF, ssh stops."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._end_channels()
        self.ssh.stop()
