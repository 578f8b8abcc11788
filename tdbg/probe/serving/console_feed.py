"""The run's console on the socket: new lines each tick, the ring's tail to a client attaching."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tdbg.probe import console
from tdbg.protocol.framing import pack
from tdbg.protocol.messages.console import MAX_LINE, MAX_LINES, ConsoleLines

# Lines sent a tick (10 Hz): a flood beyond 20,000 lines/s is sent as its newest lines, the rest
# counted as dropped (the gap in the numbers), so that neither this thread's GIL time nor the
# clients' queues grow with the flood (R41, R42).
MAX_PER_TICK = 2000


def _lines(
    first: int,
    kept: list[tuple[int, bytes]],
    open_: dict[int, bytes],
    step: int | None,
    history: bool,
) -> list[ConsoleLines]:
    out: list[ConsoleLines] = []
    for i in range(0, len(kept), MAX_LINES):
        chunk = kept[i : i + MAX_LINES]
        out.append(
            ConsoleLines(
                first + i,
                tuple(s for s, _ in chunk),
                tuple(_decoded(b) for _, b in chunk),
                step=step,
                history=history,
            )
        )
    shown = tuple((s, _decoded(b)) for s, b in sorted(open_.items()))
    if out:
        out[-1] = ConsoleLines(out[-1].seq, out[-1].streams, out[-1].texts, shown, step, history)
    elif shown or not history:
        out.append(ConsoleLines(first, (), (), shown, step, history))
    return out


def _decoded(line: bytes) -> str:
    return line.decode("utf-8", "replace")[:MAX_LINE]


class ConsoleFeed:
    """What of the process's console capture (:mod:`tdbg.probe.console`) the clients have
    been sent; probe thread only."""

    def __init__(self, capture: Callable[[], console.Capture | None] = console.current):
        self._capture = capture
        self.next_seq = 0  # the first line not sent yet
        self.dropped = 0  # lines never sent: dropped by the ring or by MAX_PER_TICK
        self._revision = -1
        self._open: dict[int, bytes] = {}  # the unfinished lines as last sent

    def frames(self, step: int | None, record: Callable[[str, bytes], None]) -> list[bytes]:
        """This tick's new lines (and unfinished lines that changed) as frames, each also
        handed to ``record`` (the recording's thinned ``console`` kind)."""
        tee = self._capture()
        if tee is None:
            return []
        tee.pump()  # the Python-level capture's writes since the last tick: cut into lines now
        if tee.revision == self._revision:
            return []
        self._revision = tee.revision
        first, kept, open_ = tee.since(self.next_seq, MAX_PER_TICK)
        if not kept and open_ == self._open:
            return []
        self.dropped += max(0, first - self.next_seq)
        if len(kept) > MAX_PER_TICK:
            skip = len(kept) - MAX_PER_TICK
            first, kept = first + skip, kept[skip:]
            self.dropped += skip
        self.next_seq = first + len(kept)
        self._open = open_
        out: list[bytes] = []
        for message in _lines(first, kept, open_, step, history=False):
            out.append(pack(message.to_wire()))
            record("console", out[-1])
        return out

    def replay(self) -> list[dict[str, Any]]:
        """The ring's lines already sent live (the newest RING_LINES), for a client attaching."""
        tee = self._capture()
        if tee is None:
            return []
        first, kept, _ = tee.since(0)
        kept = kept[: max(0, self.next_seq - first)]
        return [m.to_wire() for m in _lines(first, kept, self._open, None, history=True)]
