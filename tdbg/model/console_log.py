"""ConsoleLog: the run's stdout/stderr lines as the reader holds them, bounded and searchable."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tdbg.protocol.messages.console import STDERR, ConsoleLines

KEEP_LINES = 5000  # as many as the probe's ring: a late reader and a live one hold the same

# What a terminal would act on rather than show: escape sequences (colours, cursor moves, titles,
# links) and the control characters but tab. A run's text (a recording may come from anyone's
# run) is shown, never obeyed.
_ESCAPES = re.compile(
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC (a title, a link) to BEL or ST
    r"|\x1b\[[0-?]*[ -/]*[@-~]"  # CSI (colours, cursor moves)
    r"|\x1b.?"  # any other escape
    r"|[\x00-\x08\x0a-\x1f\x7f-\x9f]"  # control characters but tab
)
_SGR = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    """``text`` without escape sequences or control characters (a tab kept)."""
    return _ESCAPES.sub("", text)


def coloured(text: str) -> str:
    """``text`` with its colours (SGR sequences) and nothing else a terminal would act on."""
    return _ESCAPES.sub(lambda m: m[0] if _SGR.fullmatch(m[0]) else "", text)


@dataclass(frozen=True, slots=True)
class ConsoleLine:
    seq: int
    stream: int
    text: str  # as written, colours and all
    plain: str = field(default="", compare=False)  # without escapes: what a search reads

    @property
    def stderr(self) -> bool:
        return self.stream == STDERR


class ConsoleLog:
    """The newest KEEP_LINES lines by sequence number (a repeat is ignored), each stream's
    unfinished line, and how many lines never arrived (``missed``: dropped by the probe in a
    flood, or by the ring before this reader attached after the run's start)."""

    def __init__(self, keep: int = KEEP_LINES) -> None:
        self.lines: deque[ConsoleLine] = deque(maxlen=keep)
        self.open: tuple[tuple[int, str], ...] = ()
        self.next_seq = 0
        self.missed = 0
        self.revision = 0

    @classmethod
    def of(cls, messages: Iterable[ConsoleLines]) -> ConsoleLog:
        log = cls()
        for message in messages:
            log.add(message)
        return log

    def add(self, message: ConsoleLines) -> None:
        seq = message.seq
        skip = max(0, self.next_seq - seq)  # lines already held
        if seq > self.next_seq:
            self.missed += seq - self.next_seq
        texts = message.texts[skip:]
        streams = message.streams[skip:]
        self.lines.extend(
            ConsoleLine(seq + skip + i, stream, text, plain(text))
            for i, (stream, text) in enumerate(zip(streams, texts, strict=True))
        )
        self.next_seq = max(self.next_seq, seq + len(message.texts))
        self.open = message.open
        self.revision += 1

    def shown(self) -> list[ConsoleLine]:
        """Every line held, then the unfinished ones (numbered after the last)."""
        out = list(self.lines)
        out.extend(
            ConsoleLine(self.next_seq, stream, text, plain(text))
            for stream, text in self.open
            if text
        )
        return out


def matches(lines: list[ConsoleLine], query: str) -> list[int]:
    """The indices of the lines holding ``query`` (case-insensitive unless it has a capital,
    as less and vim's smartcase do)."""
    if not query:
        return []
    if query != query.lower():
        return [i for i, line in enumerate(lines) if query in line.plain]
    low = query.lower()
    return [i for i, line in enumerate(lines) if low in line.plain.lower()]
