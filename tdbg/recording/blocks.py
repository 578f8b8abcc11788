"""The recording's block writer: frames in blocks, each closed by a ``record_mark`` checking it."""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable

from tdbg.protocol.framing import pack

BLOCK_BYTES = 1 << 20  # a compacted file closes a block every this many bytes


def mark(data: bytes, last_step: int | None) -> bytes:
    """The ``record_mark`` frame closing a block of ``data``: its CRC and length (a reader
    trusts a block only when both agree), the last step in it and when it was written."""
    msg = {"type": "record_mark", "crc": zlib.crc32(data), "bytes": len(data)}
    msg.update(step=last_step, time=time.time())
    return pack(msg)


def write_all(fd: int, data: bytes, wrote: Callable[[int], None]) -> None:
    """Write all of ``data`` to ``fd`` (os.write may take part of it), telling ``wrote`` each
    part as it lands, so a writer that fails midway knows how much of the file is there."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        wrote(n)
        view = view[n:]


def block(data: bytes, last_step: int | None) -> bytes:
    """``data`` and the mark that closes it, to go to the file in one write."""
    return data + mark(data, last_step)


class BlockWriter:
    """Writes frames to ``fd`` in blocks of about BLOCK_BYTES, each closed by its mark."""

    def __init__(self, fd: int, head: bytes) -> None:
        self.fd = fd
        self.size = 0
        self.last_step: int | None = None
        self._buf = bytearray()
        self._write(head)

    def add(self, frame: bytes) -> None:
        self._buf += frame
        if len(self._buf) >= BLOCK_BYTES:
            self.close_block()

    def close_block(self) -> None:
        if not self._buf:
            return
        data = bytes(self._buf)
        self._buf.clear()
        self._write(block(data, self.last_step))

    def _write(self, data: bytes) -> None:
        write_all(self.fd, data, self._wrote)

    def _wrote(self, n: int) -> None:
        self.size += n
