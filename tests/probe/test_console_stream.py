"""The default console capture, in this process: sys.stdout and sys.stderr teed after the real
write, the probe thread's pump cutting lines, a flood bounded and counted, everything given back."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tdbg.probe import console_stream
from tdbg.probe.console_stream import StreamTee, TeeStream


@contextmanager
def swapped() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """sys.stdout and sys.stderr as two files of our own (inside the test: pytest swaps its own
    capture in between the fixtures and the test)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err = io.StringIO(), io.StringIO()
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved


def test_writes_reach_the_stream_first_and_the_ring_at_the_pump() -> None:
    with swapped() as streams:
        out, err = streams
        tee = StreamTee()
        assert tee.start()
        try:
            assert isinstance(sys.stdout, TeeStream) and sys.stdout.fileno is not None
            print("héllo")
            print("warn", file=sys.stderr)
            sys.stdout.writelines(["a\n", "b"])
            sys.stderr.write("\r 50%\r100%")
            # The real streams have it all at once; the ring only at the probe thread's pump.
            assert out.getvalue() == "héllo\na\nb" and err.getvalue() == "warn\n\r 50%\r100%"
            assert tee.total == 0
            tee.pump()
            first, lines, still_open = tee.since(0)
            assert first == 0 and sorted(lines) == [(1, b"a"), (1, "héllo".encode()), (2, b"warn")]
            assert still_open == {1: b"b", 2: b"100%"}
        finally:
            tee.stop()
        assert sys.stdout is out and sys.stderr is err
        assert [line for _, line in tee.since(0)[1]][-2:] in ([b"b", b"100%"], [b"100%", b"b"])


def test_a_failed_write_raises_as_it_would_and_keeps_nothing() -> None:
    with swapped() as streams:
        tee = StreamTee()
        assert tee.start()
        try:
            with pytest.raises(TypeError):
                sys.stdout.write(b"bytes")  # type: ignore[arg-type]
            streams[0].close()
            with pytest.raises(ValueError, match="closed"):
                print("to a closed file")
            tee.pump()
            assert tee.total == 0 and tee.open == {}
        finally:
            tee.stop()


def test_a_flood_between_two_pumps_keeps_the_newest_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with swapped() as streams:
        # Room for the newest 50 printed lines of 8 characters: two writes each (the text,
        # then "\n"), each counted with its cost; a write keeps at most 4,000 characters.
        line = 2 * console_stream.WRITE_COST + len("line 999\n")
        monkeypatch.setattr(console_stream, "INBOX_BUDGET", 50 * line)
        monkeypatch.setattr(console_stream, "MAX_WRITE", 4000)
        tee = StreamTee()
        tee.users = 1  # a probe holds it: its thread's tick pumps, not the writer
        assert tee.start()
        try:
            for i in range(1000):
                print(f"line {i}")
            assert len(sys.stdout._inbox) == 100  # type: ignore[union-attr]
            tee.pump()
            first, lines, _ = tee.since(0)
            assert tee.total == 1000 and first == 950
            assert [text for _, text in lines] == [b"line %d" % i for i in range(950, 1000)]
            # A huge write keeps its end; what came before it in the inbox is counted dropped.
            print("kept")
            sys.stdout.write("".join(f"big {i}\n" for i in range(20_000)))
            tee.pump()
            first, lines, _ = tee.since(1000)
            assert tee.total == 21_001 and lines[-1] == (1, b"big 19999")
            assert first == 21_001 - len(lines) and len(lines) < 20_000
            assert streams[0].getvalue().count("\n") == 21_001  # the stream got every byte
        finally:
            tee.stop()


def test_before_any_probe_a_full_inbox_is_cut_into_the_ring_by_its_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tdbg run``'s preload before ``watch()`` (or a script that never calls it): nobody
    pumps, so the writer that fills the inbox takes it into the ring itself; nothing is dropped
    and the ring keeps the newest lines. Once a probe holds it, a flood drops again."""
    with swapped() as streams:
        line = 2 * console_stream.WRITE_COST + len("line 999\n")
        monkeypatch.setattr(console_stream, "INBOX_BUDGET", 50 * line)
        tee = StreamTee(ring_lines=300)
        tee.pinned = True
        assert tee.start()
        try:
            for i in range(1000):
                print(f"line {i}")
            inbox = sys.stdout._inbox  # type: ignore[union-attr]
            assert 0 < len(inbox) <= 100  # never past its budget
            assert 900 <= tee.total < 1000  # the rest was cut as the inbox filled
            tee.pump()
            first, lines, _ = tee.since(0)
            assert tee.total == 1000 and first == 700  # every line counted, the newest kept
            assert [text for _, text in lines] == [b"line %d" % i for i in range(700, 1000)]

            tee.users = 1  # a probe started: its tick pumps, a flood between ticks drops
            for i in range(1000, 2000):
                print(f"line {i}")
            tee.pump()
            first, lines, _ = tee.since(1000)
            assert tee.total == 2000 and first == 1950
            assert streams[0].getvalue().count("\n") == 2000  # the stream got every byte
        finally:
            tee.stop()


def test_log_handlers_made_before_write_through_it_and_are_given_back() -> None:
    with swapped() as streams:
        _, err = streams
        handler = logging.StreamHandler()  # sys.stderr, before the tee
        logger = logging.getLogger("tdbg-test-console-stream")
        logger.addHandler(handler)
        logger.propagate = False
        tee = StreamTee()
        assert tee.start()
        held = sys.stderr
        try:
            logger.warning("a warning")
            tee.pump()
            assert tee.since(0)[1] == [(2, b"a warning")] and err.getvalue() == "a warning\n"
        finally:
            tee.stop()
            logger.removeHandler(handler)
        assert handler.stream is err
        # Someone who kept the tee (a progress bar made meanwhile) writes straight through.
        held.write("after\n")
        tee.pump()
        assert err.getvalue().endswith("after\n") and tee.total == 1


THREADS = r"""
import os, sys, threading, torch, tdbg
from tdbg.probe import console
m = torch.nn.Linear(4, 1)
probe = tdbg.watch(m, torch.optim.SGD(m.parameters(), 0.1))
print("printed")
names = sorted(t.name for t in threading.enumerate() if t.name.startswith("tdbg-"))
tee = console.current()
print(names, type(sys.stdout).__name__, tee is not None and tee.kind, file=sys.stderr)
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a forked worker: its own streams again, nothing kept for nobody
    os.write(w, type(sys.stdout).__name__.encode())
    os._exit(0)
os.waitpid(pid, 0)
print("forked child", os.read(r, 100).decode(), file=sys.stderr)
probe.close()
print(type(sys.stdout).__name__, file=sys.stderr)
"""


def test_the_default_capture_adds_no_thread(tmp_path: Path) -> None:
    """Two tdbg-* threads with the console captured, as without (the probe thread pumps); a
    forked child gets the real streams back; closing the probe gives them back."""
    env = dict(os.environ, TDBG_RUNTIME_DIR=str(tmp_path))
    del env["TDBG_CONSOLE"]
    out = subprocess.run(
        [sys.executable, "-c", THREADS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "printed\n"
    during, child, after = out.stderr.splitlines()[-3:]
    assert during == "['tdbg-sampler', 'tdbg-server'] TeeStream python", out.stderr
    assert child == "forked child TextIOWrapper"
    assert after == "TextIOWrapper"  # given back at close
