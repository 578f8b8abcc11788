"""The tdbg wire's framing, sans-IO: preamble, length-prefixed msgpack frames, the Decoder, errors.

Every connection starts with an 8-byte preamble from each side (``b"TDBG"`` + u16 min_version +
u16 max_version, big-endian), then frames: a u32 big-endian length followed by a msgpack payload.
Length 0 is invalid. A peer that announces an oversized length is rejected before a byte of the
payload is read or allocated. No pickle, no msgpack ext types, ever.

The same :class:`Decoder` serves sockets, recordings and tests: ``decoder.feed(chunk)`` returns the
messages completed by ``chunk`` whether it is 1 byte or 1 MB. What the messages hold is defined in
:mod:`tdbg.protocol.messages`; the columnar step batch in :mod:`tdbg.protocol.steps`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
PROTO_MIN = 1
PROTO_MAX = 1

MAGIC = b"TDBG"
# ``tdbg bridge --job``'s stream: every rank of a job on one node over one ssh connection, each
# rank's bytes wrapped in node messages (tdbg.protocol.messages, "node stream"); its own magic,
# so neither end mistakes it for a probe, and its own version.
NODE_MAGIC = b"TDBN"
NODE_VERSION = 1
NODE_MAX_FRAME = 1 << 20  # a node frame: a channel's chunk (at most 64 KiB) and its envelope
PREAMBLE = struct.Struct(">4sHH")
PREAMBLE_SIZE = PREAMBLE.size  # 8 bytes
FRAME_HEADER = struct.Struct(">I")

MAX_INBOUND_FRAME = 64 * 1024  # client -> probe
MAX_OUTBOUND_FRAME = 4 * 1024 * 1024  # probe -> client


class ErrorCode:
    """Error codes carried by ``error`` messages."""

    BAD_FRAME = "BAD_FRAME"
    BAD_MESSAGE = "BAD_MESSAGE"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    BUSY = "BUSY"
    RATE_LIMITED = "RATE_LIMITED"
    INTERNAL = "INTERNAL"
    TIMEOUT = "TIMEOUT"
    UNAVAILABLE = "UNAVAILABLE"
    READ_ONLY = "READ_ONLY"


class ProtocolError(Exception):
    """The peer sent something that is not tdbg protocol; the connection should be closed."""

    def __init__(self, message: str, code: str = ErrorCode.BAD_FRAME) -> None:
        super().__init__(message)
        self.code = code


def preamble(proto_min: int = PROTO_MIN, proto_max: int = PROTO_MAX, magic: bytes = MAGIC) -> bytes:
    """The 8 bytes each side sends first."""
    return PREAMBLE.pack(magic, proto_min, proto_max)


def pack(message: Mapping[str, Any], max_frame: int = MAX_OUTBOUND_FRAME) -> bytes:
    """Encode one message as a complete frame (header + payload)."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_frame:
        raise ProtocolError(
            f"message of {len(payload)} bytes exceeds the {max_frame}-byte frame cap"
        )
    return FRAME_HEADER.pack(len(payload)) + payload


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed", ErrorCode.BAD_MESSAGE)


def unpack_payload(payload: bytes) -> Any:
    """Decode one frame's payload; msgpack bounds every length by the payload size itself."""
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"undecodable payload: {exc}", ErrorCode.BAD_MESSAGE) from None


class Decoder:
    """Turns a byte stream into a preamble and messages; raises ProtocolError on bad input.

    ``max_frame`` is the cap for frames *received*: 64 KiB on the probe side, 4 MiB on a client.
    """

    def __init__(self, max_frame: int, expect_preamble: bool = True, magic: bytes = MAGIC) -> None:
        self.max_frame = max_frame
        self.magic = magic
        self.peer_versions: tuple[int, int] | None = None
        self._need_preamble = expect_preamble
        self._buf = bytearray()
        self._frame_len: int | None = None

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame (or preamble) has arrived but not all of it."""
        return bool(self._buf) or self._frame_len is not None

    def feed(self, chunk: bytes) -> list[Any]:
        self._buf += chunk
        out: list[Any] = []
        if self._need_preamble:
            if len(self._buf) < PREAMBLE_SIZE:
                if not self.magic.startswith(bytes(self._buf[:4])):
                    raise ProtocolError("peer is not speaking tdbg (bad magic)")
                return out
            magic, lo, hi = PREAMBLE.unpack_from(self._buf)
            if magic != self.magic:
                raise ProtocolError("peer is not speaking tdbg (bad magic)")
            self.peer_versions = (lo, hi)
            del self._buf[:PREAMBLE_SIZE]
            self._need_preamble = False
        while True:
            if self._frame_len is None:
                if len(self._buf) < FRAME_HEADER.size:
                    return out
                (length,) = FRAME_HEADER.unpack_from(self._buf)
                if length == 0:
                    raise ProtocolError("zero-length frame")
                if length > self.max_frame:
                    raise ProtocolError(
                        f"frame of {length} bytes exceeds the {self.max_frame}-byte cap"
                    )
                del self._buf[: FRAME_HEADER.size]
                self._frame_len = length
            if len(self._buf) < self._frame_len:
                return out
            payload = bytes(self._buf[: self._frame_len])
            del self._buf[: self._frame_len]
            self._frame_len = None
            message = unpack_payload(payload)
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                raise ProtocolError("message is not a map with a 'type'", ErrorCode.BAD_MESSAGE)
            out.append(message)


def negotiate(client: tuple[int, int], server: tuple[int, int] = (PROTO_MIN, PROTO_MAX)) -> int:
    """The protocol both sides speak, or raise ProtocolError(UNSUPPORTED_VERSION)."""
    proto = min(client[1], server[1])
    if proto < max(client[0], server[0]):
        raise ProtocolError(
            f"protocol versions do not overlap: peer speaks {client[0]}-{client[1]}, "
            f"this side {server[0]}-{server[1]}",
            ErrorCode.UNSUPPORTED_VERSION,
        )
    return proto
