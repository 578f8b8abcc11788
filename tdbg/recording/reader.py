"""Recording files: the format, and a reader that loads a damaged file up to the damage.

A recording (written by :mod:`tdbg.probe.serving.recorder`) is::

    b"TDBG-REC"  u16 format version  u16 protocol version      (12 bytes, big-endian)
    frame: {"type": "recording", "format", "proto", "tdbg", "created", "run": RunInfo}
    frame: {"type": "layers", ...}
    frames: the probe's outbound messages (steps, alert, system, probe, job, activations)
    frame: {"type": "record_mark", "crc", "bytes", "step", "time"}   after every flush
    ...
    frame: {"type": "bye", "reason": "shutdown"}                     when the run closed it

Frames are the wire's (u32 big-endian length + msgpack payload, at most 4 MiB) and are decoded by
the same :class:`~tdbg.protocol.Decoder` as a socket. A ``record_mark`` holds the CRC-32 and
length of every byte since the previous mark: the reader hands out a flushed block only once its
mark checks out, so a flipped byte stops the load at the start of its block instead of showing
wrong numbers. A file cut short (``kill -9``, disk full) loads up to its last complete frame.
Reading never raises on damage: :attr:`Recording.stopped` says where and why it stopped, and
:attr:`Recording.damaged` tells damage (a checksum mismatch, garbage) from a file merely cut short.
No torch, no textual: ``tdbg dump`` and the TUI both read recordings with this.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from tdbg.protocol.framing import FRAME_HEADER, MAX_OUTBOUND_FRAME, Decoder, ProtocolError
from tdbg.protocol.steps import last_step

REC_MAGIC = b"TDBG-REC"
FORMAT_VERSION = 1
FILE_HEADER = struct.Struct(">8sHH")  # magic, format version, protocol version: 12 bytes
READER_TYPES = frozenset({"recording", "record_mark"})  # framing of the file, not run messages


class RecordingError(Exception):
    """The file cannot be read as a recording at all (one line for the user)."""


def is_recording(path: str | os.PathLike[str]) -> bool:
    """Does ``path`` name a regular file that starts with the recording magic?"""
    try:
        with open(path, "rb") as f:
            return f.read(len(REC_MAGIC)) == REC_MAGIC
    except OSError:
        return False


class Recording:
    """One recording file: its header on open, then :meth:`messages` reads it once, in order.

    After :meth:`messages` is exhausted: ``ended`` (the run closed the file), ``stopped`` (None,
    or why reading stopped early: "recording truncated at byte N (after step S): ..."),
    ``last_step`` and ``messages_read``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.size = os.stat(self.path).st_size
            with open(self.path, "rb") as f:
                head = f.read(FILE_HEADER.size)
                if len(head) < FILE_HEADER.size or not head.startswith(REC_MAGIC):
                    raise RecordingError(f"{path} is not a tdbg recording (no TDBG-REC header)")
                _, self.format, self.proto = FILE_HEADER.unpack(head)
                if self.format != FORMAT_VERSION:
                    raise RecordingError(
                        f"{path} is a tdbg recording of format {self.format}; this tdbg reads "
                        f"format {FORMAT_VERSION}"
                    )
                first = self._read_frame(f, Decoder(MAX_OUTBOUND_FRAME, expect_preamble=False))
        except IsADirectoryError:
            raise RecordingError(f"{path} is a directory, not a recording") from None
        except OSError as exc:
            raise RecordingError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (ProtocolError, EOFError) as exc:
            raise RecordingError(f"{path}: damaged recording header: {exc}") from None
        if first is None or first[0].get("type") != "recording":
            raise RecordingError(f"{path}: damaged recording header (no run information)")
        self.header: dict[str, Any] = first[0]
        run = self.header.get("run")
        self.run: dict[str, Any] = dict(run) if isinstance(run, dict) else {}
        created = self.header.get("created")
        self.created: float | None = float(created) if isinstance(created, int | float) else None
        self.ended = False
        self.stopped: str | None = None
        self.stop_kind: str | None = None  # "truncated" (a write cut short) or "corrupt"
        self.last_step: int | None = None
        self.messages_read = 0

    @staticmethod
    def _read_frame(f: BinaryIO, decoder: Decoder) -> tuple[dict[str, Any], bytes] | None:
        """The next frame's message and raw bytes; None at a clean end of file.

        Raises ProtocolError on a bad frame and EOFError on a frame cut short."""
        head = f.read(FRAME_HEADER.size)
        if not head:
            return None
        if len(head) < FRAME_HEADER.size:
            raise EOFError("incomplete frame header")
        (length,) = FRAME_HEADER.unpack(head)
        if not 0 < length <= MAX_OUTBOUND_FRAME:
            raise ProtocolError(f"bad frame length {length}")
        payload = f.read(length)
        if len(payload) < length:
            raise EOFError(f"incomplete frame ({len(payload)} of {length} bytes)")
        raw = head + payload
        messages = decoder.feed(raw)  # exactly one frame fed: exactly one message out
        return messages[0], raw

    def messages(self, end: int | None = None) -> Iterator[dict[str, Any]]:
        """The run's messages (``layers``, ``steps``, ``alert``, ...) up to the end or the damage.

        A block of frames is handed out only once the ``record_mark`` after it checks out; the
        frames after the last mark (a write cut short) are handed out as they decode. ``end``:
        read no further than this byte (a mark boundary: compaction reads a file still growing).
        """
        decoder = Decoder(MAX_OUTBOUND_FRAME, expect_preamble=False)
        block: list[dict[str, Any]] = []
        block_start = offset = FILE_HEADER.size
        crc = 0
        try:
            f = open(self.path, "rb")  # closed in finally: the generator owns it
        except OSError as exc:
            self.stopped = f"cannot read {self.path}: {exc.strerror or exc}"
            self.stop_kind = "unreadable"
            return
        try:
            f.seek(offset)
            while end is None or offset < end:
                try:
                    item = self._read_frame(f, decoder)
                except EOFError as exc:
                    yield from self._emit(block)
                    self._stop("truncated", offset, f"{exc}: the writer stopped mid-write")
                    return
                except (ProtocolError, OSError) as exc:
                    self._stop("corrupt", block_start, f"unreadable frame at byte {offset}: {exc}")
                    return
                if item is None:
                    yield from self._emit(block)
                    return
                msg, raw = item
                mtype = msg.get("type")
                if mtype == "record_mark":
                    size = offset - block_start
                    if msg.get("crc") != crc or msg.get("bytes") != size:
                        self._stop(
                            "corrupt",
                            block_start,
                            f"checksum mismatch in bytes {block_start}-{offset}",
                        )
                        return
                    yield from self._emit(block)
                    block = []
                    offset += len(raw)
                    block_start, crc = offset, 0
                    continue
                offset += len(raw)
                crc = zlib.crc32(raw, crc)
                if mtype in READER_TYPES:
                    continue  # the header frame, already read in __init__
                block.append(msg)
            yield from self._emit(block)
        finally:
            f.close()

    def _emit(self, block: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for msg in block:
            mtype = msg.get("type")
            if mtype == "steps":
                step = last_step(msg)
                if step is not None:
                    self.last_step = step
            elif mtype == "bye":
                self.ended = True
            self.messages_read += 1
            yield msg

    def _stop(self, how: str, offset: int, why: str) -> None:
        after = "no step" if self.last_step is None else f"step {self.last_step}"
        self.stop_kind = how
        self.stopped = f"recording {how} at byte {offset} (after {after}): {why}"

    @property
    def cut_short(self) -> bool:
        """The file ends in a write cut short (a kill, a full disk) and every complete block
        checked out: the run was killed, nothing is damaged. False before reading."""
        return self.stop_kind == "truncated" or (self.stopped is None and not self.ended)

    @property
    def damaged(self) -> bool:
        """A checksum mismatch or garbage before the end: what follows it could not be read."""
        return self.stopped is not None and not self.cut_short

    @property
    def end_note(self) -> str | None:
        """What a reader should be told about how the file ends, or None when it ended cleanly."""
        if self.stopped is not None:
            return self.stopped
        if not self.ended:
            after = "no step" if self.last_step is None else f"step {self.last_step}"
            return (
                f"recording ends after {after} without the run's end marker "
                "(the process was killed, or it is still running)"
            )
        return None


def open_recording(path: str | os.PathLike[str]) -> Recording:
    """Open and validate a recording's header; raises RecordingError with a one-line reason."""
    return Recording(path)
