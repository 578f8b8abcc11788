"""``tdbg bridge --job JOB``: every rank of one job on this node over the one stdin/stdout stream.

Each rank's socket becomes a numbered channel of the node stream (protocol/messages/node.py): the
probe's bytes ride as opaque ``data`` chunks both ways, so this, like the one-run bridge, never
parses a probe's frame. Ranks that start later (or restart) are found by polling discovery.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path
from typing import Any

from tdbg import __version__
from tdbg.connect.jobs import job_entries
from tdbg.connect.node_link import hang_up
from tdbg.connect.runtime import RunEntry, discover
from tdbg.connect.waiting import wait_set
from tdbg.protocol.framing import (
    NODE_MAGIC,
    NODE_MAX_FRAME,
    NODE_VERSION,
    PROTO_MAX,
    PROTO_MIN,
    Decoder,
    ProtocolError,
    pack,
    preamble,
)
from tdbg.protocol.messages import (
    channel_close,
    channel_data,
    channel_open,
    node_hello,
    node_notice,
    read_node_message,
)

CHUNK = 1 << 16  # a channel's data chunk (well under NODE_MAX_FRAME with its envelope)
POLL_INTERVAL = 0.5  # seconds between looks for ranks that started later


class JobBridge:
    """The channels of one node stream: rank sockets on one side, ``outfd`` on the other."""

    def __init__(self, job: str, directory: Path, outfd: int) -> None:
        self.job = job
        self.directory = directory
        self.outfd = outfd
        self.done = threading.Event()
        self._out_lock = threading.Lock()
        self._lock = threading.Lock()
        self._channels: dict[int, socket.socket] = {}
        self._served: dict[tuple[int, int], int] = {}  # (rank, pid) -> its channel
        self._refused: set[tuple[int, int]] = set()  # said once, not retried
        self._next = 1

    def write(self, message: Any) -> None:
        """One frame to the local side; a broken stdout (the client left) ends the bridge."""
        self._write_bytes(pack(message, NODE_MAX_FRAME))

    def _write_bytes(self, data: bytes) -> None:
        with self._out_lock:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.outfd, view) :]
            except OSError:
                self.done.set()

    # --- bridge -> client --------------------------------------------------------------------
    def start(self) -> None:
        self._write_bytes(preamble(NODE_VERSION, NODE_VERSION, NODE_MAGIC))
        self.write(
            node_hello(
                __version__,
                (PROTO_MIN, PROTO_MAX),
                socket.gethostname(),
                str(self.directory),
                self.job,
            )
        )
        threading.Thread(target=self._watch, name="bridge-discover", daemon=True).start()

    def _watch(self) -> None:
        while not self.done.is_set():
            self.look()
            self.done.wait(POLL_INTERVAL)

    def look(self) -> None:
        """Open a channel to every rank of the job not served yet (a restart is a new pid)."""
        ranks = job_entries(discover(self.directory)).get(self.job, {})
        for rank, entry in sorted(ranks.items()):
            key = (rank, entry.pid)
            if key in self._served or key in self._refused:
                continue
            self._open(key, entry)

    def _open(self, key: tuple[int, int], entry: RunEntry) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(entry.socket))
        except OSError as exc:
            sock.close()
            self._refused.add(key)
            self.write(node_notice(f"rank {key[0]} (pid {key[1]}): {exc.strerror or exc}"))
            return
        with self._lock:
            ch = self._next
            self._next += 1
            self._channels[ch] = sock
            self._served[key] = ch
        self.write(channel_open(ch, dict(entry.meta, socket=str(entry.socket))))
        threading.Thread(
            target=self._downstream, args=(ch, key, sock), name=f"bridge-ch{ch}", daemon=True
        ).start()

    def _downstream(self, ch: int, key: tuple[int, int], sock: socket.socket) -> None:
        reason = "closed"
        try:
            while not self.done.is_set():
                data = sock.recv(CHUNK)
                if not data:
                    break
                self.write(channel_data(ch, data))
        except OSError as exc:
            reason = f"connection lost: {exc.strerror or exc}"
        with self._lock:
            self._channels.pop(ch, None)
        with contextlib.suppress(OSError):
            sock.close()
        self.write(channel_close(ch, reason))
        # The rank stays "served" while its pid lives, so a closed channel is not reopened
        # at once; a restarted rank has a new pid and gets a new channel.

    # --- client -> bridge --------------------------------------------------------------------
    def upstream(self, infd: int) -> None:
        """Read the client's frames until EOF: data to a rank's probe, or its close."""
        decoder = Decoder(NODE_MAX_FRAME, expect_preamble=False)
        try:
            while not self.done.is_set():
                chunk = os.read(infd, CHUNK)
                if not chunk:
                    break
                for raw in decoder.feed(chunk):
                    self._read_client(raw)
        except (OSError, ProtocolError):
            pass
        finally:
            self.done.set()

    def _read_client(self, raw: Any) -> None:
        self._from_client(read_node_message(raw))

    def _from_client(self, message: Any) -> None:
        if message is None or message["type"] not in ("data", "close"):
            return
        with self._lock:
            sock = self._channels.get(message["ch"])
        if sock is None:
            return  # closed meanwhile: what the client sent has nowhere to go
        try:
            if message["type"] == "data":
                sock.sendall(message["data"])
            else:
                sock.shutdown(socket.SHUT_WR)  # the client left this rank: the probe sees EOF
        except OSError:
            pass  # its downstream thread notices and closes the channel

    def close(self) -> None:
        self.done.set()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        hang_up(channels)


def serve_job(job: str, directory: Path, infd: int, outfd: int) -> int:
    """Serve job ``job``'s ranks in ``directory`` until the client closes its side."""
    bridge = JobBridge(job, directory, outfd)
    bridge.start()
    reader = threading.Thread(target=bridge.upstream, args=(infd,), name="bridge-up", daemon=True)
    reader.start()
    wait_set(bridge.done)
    bridge.close()
    return 0
