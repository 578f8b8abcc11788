"""How the console capture cuts what is written into lines (its reader's work, without fds)."""

from __future__ import annotations

import pytest

from tdbg.probe import console_tee
from tdbg.probe.console_tee import MAX_LINE, ConsoleTee, _Channel, last_state


def _channel(stream: int = 1) -> _Channel:
    return _Channel(stream, (stream,), -1, -1, False)


def test_lines_progress_bars_and_unfinished_lines() -> None:
    tee = ConsoleTee()
    out, err = _channel(1), _channel(2)
    tee._take(out, b"one\ntw")
    assert tee.since(0) == (0, [(1, b"one")], {1: b"tw"})
    tee._take(err, b"\r 10%|#\r 50%|##")
    tee._take(err, b"\r100%|###\r\n")  # a \r\n line end: the bar's last state is the line
    tee._take(out, b"o\n")
    first, lines, still_open = tee.since(1)
    assert first == 1 and lines == [(2, b"100%|###"), (1, b"two")] and still_open == {}
    assert last_state(b"abc\r") == b"abc" and last_state(b"a\rbc\r\r") == b"bc"


def test_a_trailing_carriage_return_then_new_text_replaces_the_state() -> None:
    tee = ConsoleTee()
    ch = _channel()
    tee._take(ch, b"abc\r")
    assert tee.open == {1: b"abc"}
    tee._take(ch, b"x")
    assert tee.open == {1: b"x"}
    tee._take(ch, b"\n")
    assert tee.since(0)[1] == [(1, b"x")]


def test_the_ring_and_the_lines_are_bounded() -> None:
    tee = ConsoleTee(ring_lines=100)
    ch = _channel()
    tee._take(ch, b"".join(b"line %d\n" % i for i in range(1000)))
    first, lines, _ = tee.since(0)
    assert tee.total == 1000 and first == 900 and len(lines) == 100
    assert lines[-1] == (1, b"line 999")
    assert tee.held == 100 and tee.since(950, limit=10)[0] == 990
    tee._take(ch, b"x" * (3 * MAX_LINE) + b"\n" + b"y" * (5 * MAX_LINE))
    assert tee.since(1000) == (1000, [(1, b"x" * MAX_LINE)], {1: b"y" * MAX_LINE})


def test_the_bytes_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console_tee, "RING_BYTES", 1000)
    tee = ConsoleTee()
    ch = _channel()
    for i in range(50):
        tee._take(ch, b"%03d" % i + b"." * 96 + b"\n")  # 100 bytes a line, a chunk each
    first, lines, _ = tee.since(0)
    assert tee.total == 50 and 9 <= len(lines) <= 10 and lines[-1][1].startswith(b"049")
    assert first == 50 - len(lines)


def test_the_capture_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless asked for: a crash's last lines must reach the terminal (docs/usage.md)."""
    assert console_tee.wanted(False) is False and console_tee.wanted(True) is True
    monkeypatch.delenv(console_tee.ENV, raising=False)
    assert console_tee.wanted(None) is False
    for on in ("1", "true", "YES", " on "):
        monkeypatch.setenv(console_tee.ENV, on)
        assert console_tee.wanted(None) is True, on
    for off in ("0", "false", "", "maybe"):
        monkeypatch.setenv(console_tee.ENV, off)
        assert console_tee.wanted(None) is False, off
    monkeypatch.setenv(console_tee.ENV, "1")
    assert console_tee.wanted(False) is False  # the argument wins over the variable
