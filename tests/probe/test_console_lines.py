"""How the console capture cuts what is written into lines (its reader's work, without fds)."""

from __future__ import annotations

import pytest

from tdbg.probe import console, console_ring
from tdbg.probe.console_ring import MAX_LINE, last_state
from tdbg.probe.console_tee import ConsoleTee, _Channel


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
    monkeypatch.setattr(console_ring, "RING_BYTES", 1000)
    tee = ConsoleTee()
    ch = _channel()
    for i in range(50):
        tee._take(ch, b"%03d" % i + b"." * 96 + b"\n")  # 100 bytes a line, a chunk each
    first, lines, _ = tee.since(0)
    assert tee.total == 50 and 9 <= len(lines) <= 10 and lines[-1][1].startswith(b"049")
    assert first == 50 - len(lines)


def test_the_capture_is_on_by_default_at_python_s_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """On unless turned off: the default tees sys.stdout/sys.stderr after the real write, which
    cannot hold a crash's last lines back; the fd-level tee, which can, only when asked."""
    monkeypatch.delenv(console.ENV, raising=False)
    assert console.mode(None) == "python"
    for on in ("1", "true", "YES", " on ", "", "python"):
        monkeypatch.setenv(console.ENV, on)
        assert console.mode(None) == "python", on
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv(console.ENV, off)
        assert console.mode(None) is None, off
    monkeypatch.setenv(console.ENV, " FD")
    assert console.mode(None) == "fd"
    monkeypatch.setenv(console.ENV, "maybe")  # a typo: said once, the default used
    assert console.mode(None) == "python"
    monkeypatch.setenv(console.ENV, "fd")
    # The argument wins over the variable.
    assert console.mode(False) is None and console.mode(True) == "python"
    assert console.mode("0") is None and console.mode("fd") == "fd"
    with pytest.raises(ValueError, match="one of 1, 0, fd"):
        console.mode("pty")


def test_watch_says_which_console_values_it_takes() -> None:
    from tdbg.probe.watch_args import ProbeOptions

    for good in (None, True, False, "fd", "0", "1"):
        assert ProbeOptions(console=good).console == good
    with pytest.raises(ValueError, match=r"^tdbg.watch: console must be one of 1, 0, fd"):
        ProbeOptions(console="pty")
    with pytest.raises(ValueError, match="console must be True, False, 'fd' or None"):
        ProbeOptions(console=2)  # type: ignore[arg-type]
