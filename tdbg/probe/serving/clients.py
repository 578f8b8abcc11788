"""The probe thread's clients: accepting, reading, replying to and dropping connections."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tdbg.probe.log import warn
from tdbg.probe.serving.commands import CommandDesk, Refused
from tdbg.probe.serving.connection import Buckets, Connection
from tdbg.probe.serving.endpoint import Endpoint, peer_credentials
from tdbg.protocol.framing import ErrorCode, ProtocolError, pack, preamble
from tdbg.protocol.messages import (
    COMMANDS,
    Pong,
    bye_message,
    error_message,
    validate_client_message,
)

MAX_CLIENTS = 8
MAX_MESSAGES_PER_READ = 128  # far above any real client's batch; a flood is dropped
GOODBYE_SECONDS = 5.0  # a dropped client's bye waits this long for it to read again


class ClientLoop:
    """What the probe thread's selector loop does for each client (ProbeServer's part that
    speaks to sockets): the listener's accepts, a client's reads, its messages and commands,
    flushing what is queued for it, and its goodbye. Never blocks: every socket is
    non-blocking, and a client that stops reading is dropped, never waited for."""

    # ProbeServer's, set in its __init__.
    endpoint: Endpoint
    desk: CommandDesk | None
    rejected_peers: int
    _clients: list[Connection]
    _closing: list[Connection]
    _buckets: Buckets
    _selector: selectors.BaseSelector
    _wake_r: socket.socket
    _wake_w: socket.socket
    _on_error: Callable[[BaseException], None]

    def wake(self) -> None:
        """Wake the selector loop (from any thread)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x", socket.MSG_DONTWAIT)

    def _welcome(self, conn: Connection, args: dict[str, Any], mid: int) -> None:
        """A client's hello: the version agreed, then the run so far (ProbeServer's)."""
        raise NotImplementedError

    def _on_ready(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        else:
            conn: Connection = key.data
            if conn.closing_until is not None:  # dropped: only its goodbye still goes out
                if mask & selectors.EVENT_READ:
                    with contextlib.suppress(OSError):
                        conn.sock.recv(65536)
                self._flush_goodbyes(time.monotonic())
                return
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if not conn.closed and mask & selectors.EVENT_WRITE:
                self._flush(conn)

    def _accept(self) -> None:
        listener = self.endpoint.listener
        if listener is None:
            return
        for _ in range(MAX_CLIENTS * 2):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._on_error(exc)
                return
            try:
                pid, uid, _gid = peer_credentials(sock)
            except (OSError, AttributeError):  # no SO_PEERCRED here: nobody is let in
                sock.close()
                continue
            if uid != os.geteuid():  # closed before a byte is read
                self.rejected_peers += 1
                warn(f"tdbg: refused a connection from uid {uid} (pid {pid})")
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(sock, pid)
            conn.bucket = self._buckets.of(pid)  # its rate limit survives reconnecting
            conn.append(preamble())
            if len(self._clients) >= MAX_CLIENTS:
                busy = f"this probe already serves {MAX_CLIENTS} clients"
                conn.append(pack(error_message(ErrorCode.BUSY, 0, busy)))
                conn.flush()
                conn.close()
                continue
            self._clients.append(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._flush(conn)

    def _drop(self, conn: Connection, reason: str | None = None) -> None:
        if conn.closed:
            return
        with contextlib.suppress(ValueError):
            self._clients.remove(conn)
        if reason:
            conn.goodbye(pack(bye_message(reason)))
        # Best effort, non-blocking: an error reply queued just before (UNSUPPORTED_VERSION,
        # BAD_FRAME, ...) must reach the peer before the close (guarantees: wire).
        if conn.flush() and reason and conn.outbuf and len(self._closing) < MAX_CLIENTS:
            # The kernel's buffer is full (a client that stopped reading): its goodbye waits
            # behind the frame in flight for GOODBYE_SECONDS, in case the client reads again.
            conn.closing_until = time.monotonic() + GOODBYE_SECONDS
            self._closing.append(conn)
            return
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.close()

    def _flush_goodbyes(self, now: float) -> None:
        for conn in list(self._closing):
            done = not conn.flush() or not conn.outbuf
            if done or now > (conn.closing_until or 0.0):
                self._closing.remove(conn)
                self._close(conn)

    def _flush(self, conn: Connection) -> None:
        if not conn.flush():
            self._drop(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self._selector.get_key(conn.sock).events != events:
                self._selector.modify(conn.sock, events, conn)

    def _read(self, conn: Connection) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not chunk:
            self._drop(conn)
            return
        try:
            messages = conn.decoder.feed(chunk)
        except ProtocolError as exc:
            # The stream can no longer be framed: say why, then close.
            self._reply_error(conn, exc.code, 0, str(exc))
            self._drop(conn)
            return
        if len(messages) > MAX_MESSAGES_PER_READ:
            # A legitimate client never batches this much; decoding more would only burn the
            # probe thread's GIL time.
            self._reply_error(conn, ErrorCode.RATE_LIMITED, 0, "too many messages at once")
            self._drop(conn)
            return
        for message in messages:
            if conn.closed:
                return
            self._handle(conn, message)
        if not conn.closed:
            self._flush(conn)

    def _reply_error(self, conn: Connection, code: str, mid: Any, message: str) -> None:
        conn.append(pack(error_message(code, mid if isinstance(mid, int) else 0, message)))

    def _handle(self, conn: Connection, message: dict[str, Any]) -> None:
        mid = message.get("id", 0)
        try:
            validate_client_message(message)
        except ProtocolError as exc:
            self._reply_error(conn, exc.code, mid, str(exc))
            if not conn.handshaken or conn.count_error():
                self._drop(conn)
            return
        mtype = message["type"]
        if not conn.handshaken:
            if mtype != "hello":
                self._reply_error(
                    conn, ErrorCode.BAD_MESSAGE, mid, "the first message must be hello"
                )
                self._drop(conn)
                return
            self._welcome(conn, message["args"], mid)
            return
        if not conn.take_token():
            self._reply_error(conn, ErrorCode.RATE_LIMITED, mid, "more than 20 messages/s")
            if conn.count_rate_limited():  # refused, yet it keeps flooding: close it
                self._drop(conn)
            return
        if mtype == "ping":
            pong: Pong = {"type": "pong", "id": mid}
            conn.queue(pack(pong))
        elif mtype in COMMANDS:
            self._command(conn, mtype, mid, message["args"])
        elif mtype == "bye":
            self._drop(conn)
        else:  # a known type that is not valid after the handshake (a second hello)
            self._reply_error(conn, ErrorCode.BAD_MESSAGE, mid, f"unexpected {mtype}")
            if conn.count_error():
                self._drop(conn)

    def _command(self, conn: Connection, command: str, mid: int, args: dict[str, Any]) -> None:
        if self.desk is None:
            self._reply_error(conn, ErrorCode.UNAVAILABLE, mid, "this probe takes no commands")
            return
        try:
            ack = self.desk.submit(command, args, (conn.peer_pid, os.geteuid()), "manual")
        except Refused as exc:
            self._reply_error(conn, exc.code, mid, str(exc))
            return
        except Exception as exc:  # a handler's bug is the client's INTERNAL, nothing more
            self._on_error(exc)
            self._reply_error(conn, ErrorCode.INTERNAL, mid, f"internal error: {exc}"[:300])
            return
        conn.queue(pack(replace(ack, id=mid).to_wire()))
        self.wake()
