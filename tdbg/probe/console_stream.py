"""The run's console at Python's level: ``sys.stdout`` and ``sys.stderr`` teed, no thread.

Each stream is replaced by a :class:`TeeStream` whose ``write`` calls the real stream's first,
synchronously, exactly as without tdbg (so a crash's last words, and everything a buffer would
hold, reach the terminal or file as they would have), then appends a reference to the text to an
inbox: a ``deque`` append, no lock, no copy, no system call. The probe thread takes the inbox at
each tick (:meth:`StreamTee.pump`) and cuts it into the ring's lines. Nothing else changes: fds 1
and 2, ``isatty()``, the buffering, the terminal's window size are the real stream's own.

Bounded: what waits for the probe thread is at most ``INBOX_BUDGET`` (the characters written plus
``WRITE_COST`` a write: 8 MB holds ~40,000 printed lines, a tick of any flood a terminal or a file
takes); past that the oldest writes are dropped and their lines counted, and one write keeps at
most its last ``MAX_WRITE`` characters. A writer pays a deque append and two integer updates.
Before any probe holds the capture (``tdbg run``'s preload, a script that has not called
``watch()`` yet, or never does), nobody pumps: the writer that finds the inbox full cuts it into
the ring itself, once per ``INBOX_BUDGET`` (about half the cost a line of dropping write by
write), and the ring keeps the newest lines as a probe would.

What it does not see: C-level writes to fds 1 and 2 (torch's C++ warnings, NCCL, faulthandler),
child processes, forked workers (their copy passes writes through, nothing kept), and code that
writes bytes to ``sys.stdout.buffer``, writes to ``sys.__stdout__`` or held ``sys.stdout.write``
from before. ``TDBG_CONSOLE=fd`` captures
at the fd level instead (:mod:`tdbg.probe.console_tee`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tdbg.probe.console_ring import RING_LINES, ConsoleRing

INBOX_BUDGET = (
    8 << 20
)  # what waits for the probe thread's tick: characters, plus WRITE_COST a write
WRITE_COST = 64  # a small write's own cost in memory (its str object, its deque slot)
MAX_WRITE = 1 << 20  # characters kept of one write: its end (its earlier lines counted dropped)
STDOUT, STDERR = 1, 2


@dataclass
class _Lane:
    """What one or two streams wrote (both when they go to one file: one order, one stream)."""

    stream: int
    inbox: deque[Any] = field(default_factory=deque)
    pending: bytes = b""  # the line not finished yet (the probe thread's)
    dropped: int = 0  # lines dropped from the inbox since the last pump (a flood)
    # What the inbox holds, in INBOX_BUDGET's units, in a one-item list the writers' closure
    # reads and sets without a lock (two threads can lose an update): recounted at each pump.
    held: list[int] = field(default_factory=lambda: [0])


class TeeStream:
    """Stands in for ``sys.stdout`` or ``sys.stderr``: ``write`` goes to the real stream, then a
    reference into the inbox; every other attribute is the real stream's."""

    def __init__(
        self, real: Any, lane: _Lane, take_unwatched: Callable[[], bool] | None = None
    ) -> None:
        self._real = real
        self._real_write = real.write
        self._lane = lane
        self._inbox = lane.inbox
        self._take_unwatched = take_unwatched  # empties the inbox where no probe pumps it
        # An instance attribute, a closure: print() finds it first and calls it with no method
        # binding, its names are cells (measured: a third of a bound method's cost a write);
        # passing through (after a fork, at stop) is the real stream's own bound method.
        self.write = _tee(real, lane, self._spill)

    def _spill(self, text: Any) -> None:
        """The inbox is full (a flood between two ticks) or the write is huge: keep the newest,
        count the lines of what is dropped."""
        lane, inbox, held = self._lane, self._inbox, self._lane.held
        try:
            take = self._take_unwatched
            if len(text) <= MAX_WRITE and take is not None and take():
                held[0] += len(text) + WRITE_COST  # the inbox was cut into the ring: room
                inbox.append(text)
                return
            if len(text) > MAX_WRITE:
                # What came before this write's end is dropped too: the gap stays in one place.
                lane.dropped += text.count("\n", 0, len(text) - MAX_WRITE)
                text = text[-MAX_WRITE:]
                while inbox:
                    lane.dropped += inbox.popleft().count("\n")
                held[0] = 0
            size = len(text) + WRITE_COST
            while inbox and held[0] + size > INBOX_BUDGET:
                old = inbox.popleft()
                held[0] -= len(old) + WRITE_COST
                lane.dropped += old.count("\n")
            held[0] += size
            inbox.append(text)
        except Exception:  # the probe thread took the inbox meanwhile; bytes have no "\n" str
            pass

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def pass_through(self) -> None:
        """From now on every write is the real stream's alone."""
        self.write = self._real_write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _tee(real: Any, lane: _Lane, spill: Callable[[Any], None]) -> Callable[[Any], Any]:
    """The write that replaces ``real.write``: the real one first, as it was (it raises as it
    would, nothing kept then), then the text into the lane's inbox while it has room."""
    real_write, append, held = real.write, lane.inbox.append, lane.held
    budget, cost = INBOX_BUDGET, WRITE_COST

    def write(text: Any) -> Any:
        n = real_write(text)
        size = held[0] + len(text) + cost
        if size <= budget:
            held[0] = size
            append(text)
        else:
            spill(text)
        return n

    if isinstance(real, io.TextIOBase):
        return write  # takes str only: len() cannot fail after its write

    def guarded(text: Any) -> Any:  # a stream of unknown kind: what it takes may have no len()
        n = real_write(text)
        try:
            size = held[0] + len(text) + cost
            if size <= budget:
                held[0] = size
                append(text)
            else:
                spill(text)
        except Exception:
            pass
        return n

    return guarded


def _same_file(a: Any, b: Any) -> bool:
    try:
        one, two = os.fstat(a.fileno()), os.fstat(b.fileno())
    except Exception:  # no fileno (a notebook's stream, pytest's capture): told apart
        return False
    return (one.st_dev, one.st_ino) == (two.st_dev, two.st_ino)


class StreamTee(ConsoleRing):
    """Tees this process's ``sys.stdout`` and ``sys.stderr``; the probe thread pumps the inbox."""

    kind = "python"

    def __init__(self, ring_lines: int = RING_LINES) -> None:
        super().__init__(ring_lines)
        self._pid = os.getpid()
        self._lanes: list[_Lane] = []
        self._installed: list[tuple[str, TeeStream, Any]] = []  # (sys attribute, tee, real)
        self._moved: list[tuple[Any, Any, TeeStream]] = []  # (log handler, its stream, tee)
        self._pump_lock = threading.Lock()
        self.running = False
        self.failed: str | None = None
        self.users = 0  # probes holding it
        self.pinned = False  # held until exit (tdbg run)

    def start(self) -> bool:
        """Tee the two streams; False (and nothing changed) when neither can be."""
        if self.running:
            return True
        if self._installed:
            return False  # started once and stopped: not restarted
        out, err = sys.stdout, sys.stderr
        lanes: dict[str, _Lane] = {}
        if _teeable(out):
            lanes["stdout"] = _Lane(STDOUT)
        if _teeable(err):
            shared = "stdout" in lanes and _same_file(out, err)
            lanes["stderr"] = lanes["stdout"] if shared else _Lane(STDERR)
        if not lanes:
            self.failed = "sys.stdout and sys.stderr cannot be teed"
            return False
        for name, lane in lanes.items():
            real = getattr(sys, name)
            tee = TeeStream(real, lane, self._take_unwatched)
            setattr(sys, name, tee)
            self._installed.append((name, tee, real))
            if lane not in self._lanes:
                self._lanes.append(lane)
        self._move_log_handlers()
        self.running = True
        return True

    def _move_log_handlers(self) -> None:
        """A logging handler made before the tee (``basicConfig`` at the top of the script)
        holds the real stream: it writes through the tee too, and is given back at stop."""
        logging = sys.modules.get("logging")
        if logging is None:
            return
        with contextlib.suppress(Exception):
            loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]
            by_real = {id(real): tee for _, tee, real in self._installed}
            for logger in loggers:
                for handler in list(getattr(logger, "handlers", ())):
                    stream = getattr(handler, "stream", None)
                    tee = by_real.get(id(stream))
                    if isinstance(handler, logging.StreamHandler) and tee is not None:
                        handler.stream = tee
                        self._moved.append((handler, stream, tee))

    def _take_unwatched(self) -> bool:
        """A writer found its inbox full: where no probe holds the capture (so none pumps it),
        cut the inbox into the ring now and say so; False where a probe's tick will."""
        if self.users > 0 or not self.running:
            return False
        self.pump()
        return True

    def pump(self, finish: bool = False) -> None:
        """Cut what was written since the last call into the ring's lines (the probe thread at
        each tick; the main thread when settling). ``finish``: an unfinished line is a line."""
        if os.getpid() != self._pid:
            return
        with self._pump_lock:
            for lane in self._lanes:
                dropped, lane.dropped = lane.dropped, 0
                if dropped:
                    self._skip(lane, dropped)
                inbox = lane.inbox
                items = []
                with contextlib.suppress(IndexError):
                    for _ in range(len(inbox)):  # not what writers add meanwhile: next tick
                        items.append(inbox.popleft())
                rest = list(inbox)  # one C call: what was written since, counted afresh
                lane.held[0] = sum(map(len, rest)) + WRITE_COST * len(rest)
                if items:
                    try:
                        text = "".join(items)
                    except TypeError:  # a stream that took bytes as well
                        text = "".join(
                            i.decode("utf-8", "replace") if isinstance(i, bytes) else str(i)
                            for i in items
                        )
                    self._take(lane, text.encode("utf-8", "replace"))
                if finish and lane.pending:
                    self._take(lane, b"\n")

    def settle(self, timeout: float = 0.0, finish: bool = False) -> bool:
        """Take everything written so far now (no thread to wait for: ``timeout`` is unused)."""
        if not self.running or os.getpid() != self._pid:
            return False
        self.pump(finish)
        return True

    def stop(self, timeout: float = 0.0) -> None:
        """Give ``sys.stdout`` and ``sys.stderr`` back (where nobody replaced them since; a tee
        left in place, or held by someone, passes writes through), the last lines kept."""
        if not self.running or os.getpid() != self._pid:
            return
        self.pump(finish=True)
        self.running = False
        for name, tee, real in self._installed:
            tee.pass_through()
            if getattr(sys, name, None) is tee:
                setattr(sys, name, real)
        for handler, stream, tee in self._moved:
            if getattr(handler, "stream", None) is tee:
                handler.stream = stream
        self._moved.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: nobody pumps its inbox; its writes pass through, nothing kept, and
        its own streams are the real ones again (a probe it starts captures afresh)."""
        self.running = False
        for name, tee, real in self._installed:
            tee.pass_through()
            if getattr(sys, name, None) is tee:
                setattr(sys, name, real)
        for lane in self._lanes:
            lane.inbox.clear()


def _teeable(stream: Any) -> bool:
    return stream is not None and not isinstance(stream, TeeStream) and hasattr(stream, "write")
