"""A blocking client for a probe's socket: connect, handshake, then read messages."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from tdbg import __version__
from tdbg.protocol import (
    MAX_INBOUND_FRAME,
    MAX_OUTBOUND_FRAME,
    Decoder,
    ProtocolError,
    client_message,
    hello,
    negotiate,
    pack,
)

HANDSHAKE_TIMEOUT = 5.0


class ConnectError(Exception):
    """Attaching failed; the message is one line meant for the user."""


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
        self._pending = pending
        self._next_id = 1
        self.closed = False

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
            sock.sendall(hello(f"tdbg {__version__}"))
            messages: list[dict[str, Any]] = []
            while not messages:
                if time.monotonic() > deadline:
                    raise ConnectError(f"{label}: no answer from the probe within {timeout:g} s")
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
        """Yield messages until the probe closes; with ``timeout``, stop when idle that long."""
        yield from self._pending
        self._pending = []
        self.sock.settimeout(timeout)
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return
            except OSError:
                return
            if not chunk:
                return
            yield from self._decoder.feed(chunk)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.send("bye")
        with contextlib.suppress(OSError):
            self.sock.close()
