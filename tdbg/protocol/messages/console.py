"""``console``: lines the training process wrote to its stdout and stderr, numbered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tdbg.protocol.messages.tolerant import as_int, as_list, as_str

STDOUT, STDERR = 1, 2
MAX_LINE = 2000  # characters of one line, as sent and as read
MAX_LINES = 500  # lines in one message: with MAX_LINE, ~4 MiB at the very worst, ~50 KiB usually


def _stream(value: Any) -> int:
    return STDERR if as_int(value) == STDERR else STDOUT


def _text(value: Any) -> str:
    text = as_str(value)
    return "" if text is None else text[:MAX_LINE]


@dataclass(frozen=True)
class ConsoleLines:
    """Lines ``seq``, ``seq + 1``, ... of the run's console, each with its stream (1: stdout,
    2: stderr; both read as 1 when they go to one terminal); a gap between two messages' numbers
    is lines the probe dropped (a flood). ``open``: each stream's unfinished line (a progress
    bar's current state), replaced by the next message's. ``step``: the run's latest step when
    they were sent (a replay shows the lines up to its cursor)."""

    seq: int
    streams: tuple[int, ...]
    texts: tuple[str, ...]
    open: tuple[tuple[int, str], ...] = ()
    step: int | None = None
    history: bool = False

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "console",
            "seq": self.seq,
            "stream": list(self.streams),
            "text": list(self.texts),
            "open": [[s, t] for s, t in self.open],
        }
        if self.step is not None:
            message["step"] = self.step
        if self.history:
            message["history"] = True
        return message

    @classmethod
    def from_wire(cls, message: Any) -> ConsoleLines | None:
        """What is well formed of a ``console`` message (a line that is not text reads as
        empty, a long one is cut, an unknown stream reads as stdout); None without ``seq``."""
        if not isinstance(message, dict):
            return None
        seq = as_int(message.get("seq"))
        if seq is None or seq < 0:
            return None
        texts = [_text(t) for t in as_list(message.get("text"))[:MAX_LINES]]
        streams = [_stream(s) for s in as_list(message.get("stream"))[: len(texts)]]
        streams += [STDOUT] * (len(texts) - len(streams))
        still_open: list[tuple[int, str]] = []
        for pair in as_list(message.get("open"))[:2]:
            items = as_list(pair)
            if len(items) == 2 and isinstance(items[1], str):
                still_open.append((_stream(items[0]), _text(items[1])))
        step = as_int(message.get("step"))
        return cls(
            seq,
            tuple(streams),
            tuple(texts),
            tuple(still_open),
            step if step is not None and step >= 0 else None,
            message.get("history") is True,
        )
