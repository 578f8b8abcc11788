"""A blocking client for a probe's socket: connect, handshake, then read messages."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from tdbg import __version__
from tdbg.protocol.framing import (
    MAX_INBOUND_FRAME,
    MAX_OUTBOUND_FRAME,
    Decoder,
    ProtocolError,
    negotiate,
    pack,
)
from tdbg.protocol.messages import client_message, hello

HANDSHAKE_TIMEOUT = 5.0


class ConnectError(Exception):
    """Attaching failed; the message is one line meant for the user."""


class CommandRefused(Exception):
    """The probe refused a command (its ``error`` reply); ``str()`` is its one-line reason."""

    def __init__(self, command: str, code: str, message: str) -> None:
        super().__init__(message or f"{command} refused ({code})")
        self.command = command
        self.code = code


class CommandTimeout(Exception):
    """No answer (ack or refusal) to a command: not in time, or the probe closed first."""


class ProbeClient:
    """One connection to a probe. ``welcome`` holds the probe's answer to our hello."""

    def __init__(
        self,
        sock: socket.socket,
        welcome: dict[str, Any],
        decoder: Decoder,
        pending: list[dict[str, Any]],
    ) -> None:
        self.sock = sock
        self.welcome = welcome
        self.run: dict[str, Any] = dict(welcome.get("run") or {})
        self._decoder = decoder
        # Messages decoded but not yet handed out: messages() pops them one at a time, so a
        # caller that stops iterating early (or command(), which sets aside what it is not
        # waiting for) loses nothing.
        self._pending: deque[dict[str, Any]] = deque(pending)
        self._next_id = 1
        self.closed = False
        self.peer_closed = False  # the probe closed the connection (EOF or reset)

    @classmethod
    def connect(
        cls, path: str | os.PathLike[str], timeout: float = HANDSHAKE_TIMEOUT
    ) -> ProbeClient:
        target = os.fspath(path)
        if not os.path.exists(target):
            raise ConnectError(f"no such socket: {target}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(target)
        except OSError as exc:
            sock.close()
            raise ConnectError(f"cannot connect to {target}: {exc.strerror or exc}") from None
        try:
            return cls.handshake(sock, target, timeout)
        except BaseException:
            sock.close()
            raise

    @classmethod
    def handshake(cls, sock: socket.socket, label: str, timeout: float) -> ProbeClient:
        decoder = Decoder(MAX_OUTBOUND_FRAME)
        deadline = time.monotonic() + timeout
        try:
            # The whole handshake shares one deadline, whatever timeout the socket had before
            # (a caller that peeked at it in short slices may have left a short one).
            sock.settimeout(timeout)
            try:
                sock.sendall(hello(f"tdbg {__version__}"))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the probe may have refused us already (BUSY) and closed: read why below
            messages: list[dict[str, Any]] = []
            while not messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectError(f"{label}: no answer from the probe within {timeout:g} s")
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    if decoder.peer_versions is None:
                        raise ConnectError(f"{label} closed the connection: not a tdbg probe")
                    raise ConnectError(f"{label} closed the connection during the handshake")
                messages = decoder.feed(chunk)
        except ProtocolError as exc:
            raise ConnectError(f"{label} is not a tdbg probe ({exc})") from None
        except TimeoutError:
            raise ConnectError(f"{label}: no answer from the probe within {timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"{label}: {exc.strerror or exc}") from None
        first, rest = messages[0], messages[1:]
        if first.get("type") == "error":
            raise ConnectError(f"{label} refused the connection: {first.get('message')}")
        if first.get("type") != "welcome":
            raise ConnectError(f"{label} answered {first.get('type')!r} instead of welcome")
        assert decoder.peer_versions is not None
        try:
            negotiate(decoder.peer_versions)
        except ProtocolError as exc:
            raise ConnectError(f"{label}: {exc}") from None
        sock.settimeout(None)
        return cls(sock, first, decoder, rest)

    def send(self, mtype: str, **args: Any) -> int:
        mid = self._next_id
        self._next_id += 1
        self.sock.sendall(pack(client_message(mtype, mid, **args), MAX_INBOUND_FRAME))
        return mid

    def messages(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield messages until the probe closes; with ``timeout``, stop when idle that long.

        Safe to stop early: whatever was decoded and not yet yielded is kept for the next call.
        """
        while True:
            while self._pending:
                yield self._pending.popleft()
            if self.peer_closed:
                return
            self.sock.settimeout(timeout)
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return
            except OSError:
                self.peer_closed = True
                return
            if not chunk:
                self.peer_closed = True
                return
            self._pending.extend(self._decoder.feed(chunk))

    def command(self, mtype: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        """Send a command and wait for its answer; return the ``ack`` (see :meth:`reply`)."""
        try:
            mid = self.send(mtype, **args)
        except OSError:  # EPIPE/ECONNRESET: the probe is gone
            self.peer_closed = True
            raise CommandTimeout(
                f"the run closed the connection before answering {mtype}"
            ) from None
        return self.reply(mid, mtype, timeout)

    def reply(self, mid: int, mtype: str, timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the answer to the command sent as ``mid``; return the ``ack``.

        Raises CommandRefused (with the probe's code) on a refusal, CommandTimeout when no
        answer comes within ``timeout`` seconds or the probe closes first. Every other message
        read meanwhile (``job`` progress, steps, alerts, ``bye``) stays queued, in order, for
        messages(). Blocking; it reads the socket, so no other thread may read this client.
        """
        deadline = time.monotonic() + timeout
        held: list[dict[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommandTimeout(f"no answer to {mtype} within {timeout:g} s")
                for msg in self.messages(timeout=min(left, 0.5)):
                    if msg.get("id") == mid and msg.get("type") in ("ack", "error"):
                        if msg["type"] == "error":
                            code = str(msg.get("code") or "")
                            raise CommandRefused(mtype, code, str(msg.get("message") or ""))
                        return msg
                    held.append(msg)
                    if time.monotonic() >= deadline:
                        break
                if self.peer_closed:
                    raise CommandTimeout(f"the run closed the connection before answering {mtype}")
        finally:
            # Put back what was read meanwhile, ahead of anything still undelivered.
            self._pending.extendleft(reversed(held))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.send("bye")
        with contextlib.suppress(OSError):
            self.sock.close()
