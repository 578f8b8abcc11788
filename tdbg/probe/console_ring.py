"""The run's console kept: what was written, as whole chunks, cut into lines only when read."""

from __future__ import annotations

import threading
from collections import deque
from itertools import repeat
from typing import Protocol

RING_LINES = 5000  # the lines kept; older ones are dropped, their count kept by the sequence
RING_BYTES = 8 << 20  # ... and at most this much of what was written (very long lines: fewer)
MAX_LINE = 2000  # bytes kept of one line (and of a line not finished yet): 10 MB ring at most


class Lane(Protocol):
    """One captured stream as the ring sees it: its number and its line not finished yet."""

    stream: int
    pending: bytes


def last_state(line: bytes) -> bytes:
    """A line as a terminal leaves it after carriage returns: what follows the last ``\\r``
    (a progress bar's final state), a trailing ``\\r`` (``\\r\\n`` line ends) not counted."""
    body = line.rstrip(b"\r")
    return body.rpartition(b"\r")[2] if b"\r" in body else body


class ConsoleRing:
    """The newest lines of a console; written by one capture, ``since(seq)`` read by any thread."""

    def __init__(self, ring_lines: int = RING_LINES) -> None:
        # What was written, as taken: (stream, first line's number, complete lines, how many).
        # Kept whole and cut into lines only when asked (since()): a flood costs a count of
        # newlines a chunk, not a Python object a line.
        self._chunks: deque[tuple[int, int, bytes, int]] = deque()
        self.ring_lines = ring_lines
        self._held_lines = 0
        self._held_bytes = 0
        self.total = 0  # lines completed so far (kept or not): the next line's sequence number
        self.open: dict[int, bytes] = {}  # per stream, its unfinished line (a progress bar)
        self.revision = 0  # changes whenever lines or open lines do
        self._lock = threading.Lock()  # held for a deque extend or copy, nothing longer

    def pump(self) -> None:
        """Take what was written since the last call (the probe thread, each tick): nothing
        for a capture that takes it as it comes."""

    def _take(self, lane: Lane, data: bytes) -> None:
        """Keep the complete lines of what was written, as one chunk (C-level work only)."""
        stream = lane.stream
        joined = lane.pending + data
        end = joined.rfind(b"\n")
        if end < 0:
            lane.pending = _tail(joined)
            with self._lock:
                self.open[stream] = last_state(lane.pending)
                self.revision += 1
            return
        body = joined[: end + 1]
        lane.pending = rest = _tail(joined[end + 1 :])
        n = body.count(b"\n")
        chunks = self._chunks
        with self._lock:
            chunks.append((stream, self.total, body, n))
            self.total += n
            self._held_lines += n
            self._held_bytes += len(body)
            while len(chunks) > 1 and (
                self._held_lines - chunks[0][3] >= self.ring_lines or self._held_bytes > RING_BYTES
            ):
                _, _, old, k = chunks.popleft()
                self._held_lines -= k
                self._held_bytes -= len(old)
            if rest:
                self.open[stream] = last_state(rest)
            else:
                self.open.pop(stream, None)
            self.revision += 1

    def _skip(self, lane: Lane, lines: int) -> None:
        """``lines`` lines were written but never reached the ring (dropped in a flood): their
        numbers are left out, and the unfinished line they ended is gone with them."""
        lane.pending = b""
        with self._lock:
            self.total += lines
            self.open.pop(lane.stream, None)
            self.revision += 1

    def since(
        self, seq: int, limit: int | None = None
    ) -> tuple[int, list[tuple[int, bytes]], dict[int, bytes]]:
        """``(first, lines, open)``: the kept lines from sequence ``seq`` on (from the oldest
        kept when ``seq`` is older: ``first - seq`` lines were dropped; at most the newest
        ``limit``), each cut to MAX_LINE bytes, a progress bar at its last state; then the
        unfinished lines by stream. The cutting into lines is done here, for these lines only."""
        with self._lock:
            total = self.total
            chunks = list(self._chunks)
            still_open = dict(self.open)
        # Lines dropped before they reached the ring (_skip) leave a gap in the numbers: the
        # lines given are numbered from ``first`` on, so only the newest run without a gap.
        for i in range(len(chunks) - 1, 0, -1):
            if chunks[i - 1][1] + chunks[i - 1][3] != chunks[i][1]:
                chunks = chunks[i:]
                break
        start = max(seq, total - self.ring_lines, total - (limit if limit is not None else total))
        if chunks:
            start = max(start, chunks[0][1])
        start = min(start, total)
        pieces: list[list[tuple[int, bytes]]] = []
        for stream, first, body, n in reversed(chunks):
            if first + n <= start:
                break
            parts = body.split(b"\n")
            parts.pop()  # after the last newline: nothing
            if first < start:
                parts = parts[start - first :]
            if b"\r" in body:
                parts = [last_state(p) for p in parts]
            if max(map(len, parts), default=0) > MAX_LINE:
                parts = [p[:MAX_LINE] for p in parts]
            pieces.append(list(zip(repeat(stream), parts, strict=False)))
        lines = [line for piece in reversed(pieces) for line in piece]
        return start, lines, still_open

    @property
    def held(self) -> int:
        """How many lines :meth:`since` can give now (at most ``ring_lines``)."""
        with self._lock:
            return min(self.ring_lines, self._held_lines)


def _tail(pending: bytes) -> bytes:
    """An unfinished line, bounded: from its last carriage return that still matters (a trailing
    one keeps the state before it, which the terminal still shows), at most MAX_LINE bytes."""
    if b"\r" in pending:
        cut = pending.rstrip(b"\r").rfind(b"\r")
        if cut > 0:
            pending = pending[cut:]
    return pending[:MAX_LINE] if len(pending) > MAX_LINE else pending
