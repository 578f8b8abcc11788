"""ConsoleLog: lines by sequence number (repeats ignored, gaps counted), bounded, searched."""

from __future__ import annotations

from tdbg.model.console_log import ConsoleLog, coloured, matches, plain
from tdbg.protocol.messages.console import STDERR, ConsoleLines


def _lines(seq: int, *texts: str, open_: tuple[tuple[int, str], ...] = ()) -> ConsoleLines:
    return ConsoleLines(seq, (1,) * len(texts), texts, open_)


def test_repeats_are_ignored_and_gaps_counted() -> None:
    log = ConsoleLog(keep=4)
    log.add(_lines(0, "a", "b"))
    log.add(_lines(1, "b", "c"))  # a replay overlapping the live lines
    assert [line.text for line in log.lines] == ["a", "b", "c"] and log.missed == 0
    log.add(_lines(10, "k", "l", open_=((STDERR, "40%"),)))  # 3-9 dropped in a flood
    assert log.missed == 7 and log.next_seq == 12
    assert [line.text for line in log.lines] == ["b", "c", "k", "l"]  # the newest 4
    shown = log.shown()
    assert shown[-1].text == "40%" and shown[-1].stderr and shown[-1].seq == 12


def test_a_late_reader_counts_the_lines_before_its_first() -> None:
    log = ConsoleLog.of([_lines(5000, "x")])
    assert log.missed == 5000 and log.lines[0].seq == 5000


def test_search_is_smartcase_and_reads_the_plain_text() -> None:
    log = ConsoleLog.of([_lines(0, "Loss 1", "\x1b[31mloss\x1b[0m 2", "no", "31m")])
    shown = log.shown()
    assert matches(shown, "loss") == [0, 1]
    assert matches(shown, "Loss") == [0]
    assert matches(shown, "31m") == [3]  # not inside the colour's escape sequence
    assert matches(shown, "") == []


def test_escapes_are_shown_never_obeyed() -> None:
    raw = "\x1b]0;title\x07\x1b[2J\x1b[1;32mok\x1b[0m\tdone\x08\x07"
    assert plain(raw) == "ok\tdone"
    assert coloured(raw) == "\x1b[1;32mok\x1b[0m\tdone"
