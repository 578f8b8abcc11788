"""The run's console: fds 1 and 2 teed to the terminal unchanged, their lines kept in a ring.

Each captured fd is replaced by the writing end of a pty (when it was a terminal, so that
``isatty()``, the window size and progress bars behave as before) or of a pipe (a file, a pipe:
not a terminal either). One daemon thread, ``tdbg-console``, reads the other end, writes every
byte through to the original fd first, then keeps the lines. C-level writes (torch's warnings,
NCCL, a child process) are caught as well as ``print``.

What it costs the writer: the bytes are copied once more, off its thread; the ring drops its
oldest lines (counted by sequence number), so a slow reader of the ring never holds the reader
thread, and the reader never waits for anything but the terminal the writer waited for anyway.
When fds 1 and 2 are one file (one terminal, ``2>&1``) they share one channel, so their order on
the terminal is exactly the order written; stderr is told apart only when it goes elsewhere.

Nothing here imports torch. Opt in with ``watch(console=True)`` or ``TDBG_CONSOLE=1``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import sys
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

ENV = "TDBG_CONSOLE"  # "1": capture the console (off by default)
RING_LINES = 5000  # the lines kept; older ones are dropped, their count kept by the sequence
RING_BYTES = 8 << 20  # ... and at most this much of what was written (very long lines: fewer)
MAX_LINE = 2000  # bytes kept of one line (and of a line not finished yet): 10 MB ring at most
READ_BYTES = 1 << 16
PIPE_BYTES = 1 << 20  # a pipe's capacity raised where the kernel lets us: a burst never waits
SETTLE_SECONDS = 0.5  # how long closing waits for the reader to take what was written (R56)
WINSIZE_SECONDS = 1.0  # how often a pty's window size follows the real terminal's
BATCH_BYTES = 1 << 15  # a pipe's read shorter than this: the reader pauses BATCH_SECONDS
BATCH_SECONDS = 0.001
STDOUT, STDERR = 1, 2


def wanted(option: bool | None = None) -> bool:
    """Capture when ``console=True`` was passed, or (``None``) when ``$TDBG_CONSOLE`` is ``1``
    (or ``true``, ``yes``, ``on``). Off by default: the bytes a process writes just before a
    fatal signal or ``os._exit()`` are in the capture's channel, not yet on the terminal, and
    die with it (a crash's last words are what a user debugging it needs most)."""
    if option is not None:
        return bool(option)
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def last_state(line: bytes) -> bytes:
    """A line as a terminal leaves it after carriage returns: what follows the last ``\\r``
    (a progress bar's final state), a trailing ``\\r`` (``\\r\\n`` line ends) not counted."""
    body = line.rstrip(b"\r")
    return body.rpartition(b"\r")[2] if b"\r" in body else body


@dataclass
class _Channel:
    """One captured stream: the fds it replaced, the original (written through), the end read."""

    stream: int
    fds: tuple[int, ...]  # 1, 2 or both
    saved: int  # a dup of the original: where every byte still goes
    read_fd: int
    tty: bool
    pending: bytes = b""  # the line not finished yet
    open: bool = True
    restored: bool = False
    extra: list[int] = field(default_factory=list)  # fds to close with the channel


class ConsoleTee:
    """Captures fds 1 and 2 of this process; ``since(seq)`` reads the lines from any thread."""

    def __init__(self, ring_lines: int = RING_LINES) -> None:
        # What was written, as read: (stream, first line's number, complete lines, how many).
        # Kept whole and cut into lines only when asked (since()): a flood costs the reader a
        # count of newlines a chunk, not a Python object a line.
        self._chunks: deque[tuple[int, int, bytes, int]] = deque()
        self.ring_lines = ring_lines
        self._held_lines = 0
        self._held_bytes = 0
        self.total = 0  # lines completed so far: the next line's sequence number
        self.open: dict[int, bytes] = {}  # per stream, its unfinished line (a progress bar)
        self.revision = 0  # changes whenever lines or open lines do
        self._lock = threading.Lock()  # held for a deque extend or copy, nothing longer
        self._channels: list[_Channel] = []
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._stopping = False
        self._settle = threading.Event()  # asked: tell me when the pipes are empty
        self._settled = threading.Event()
        self._finish_open = False
        self.running = False
        self.failed: str | None = None  # why capture stopped early (the reader died)
        self.users = 0  # probes holding it (capture / release)
        self.pinned = False  # held until exit (tdbg run)

    # --- starting and stopping (the process's main thread) ---------------------------------
    def start(self) -> bool:
        """Tee fds 1 and 2; False (and nothing changed) when that cannot be done here."""
        if self.running:
            return True
        if self._channels:
            return False  # started once and stopped: a capture is not restarted
        try:
            self._open_channels()
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._thread = threading.Thread(
                target=self._read_loop, name="tdbg-console", daemon=True
            )
            self.running = True
            self._thread.start()
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self._restore()
            self.running = False
            return False
        return True

    def _open_channels(self) -> None:
        stats: dict[int, os.stat_result] = {}
        for fd in (STDOUT, STDERR):
            with contextlib.suppress(OSError):
                stats[fd] = os.fstat(fd)
        same = len(stats) == 2 and (stats[1].st_dev, stats[1].st_ino) == (
            stats[2].st_dev,
            stats[2].st_ino,
        )
        groups = [(STDOUT, (STDOUT, STDERR))] if same else [(fd, (fd,)) for fd in stats]
        for stream, fds in groups:
            self._channels.append(self._capture(stream, fds))

    def _capture(self, stream: int, fds: tuple[int, ...]) -> _Channel:
        first = fds[0]
        tty = os.isatty(first)
        saved = os.dup(first)  # not inheritable: children get the capture, not the original
        try:
            if tty:
                read_fd, write_fd = os.openpty()
                attrs = termios.tcgetattr(first)
                attrs[1] &= ~termios.OPOST  # bytes pass as written; the real tty translates
                termios.tcsetattr(write_fd, termios.TCSANOW, attrs)
                _copy_winsize(first, read_fd)
            else:
                read_fd, write_fd = os.pipe()
                with contextlib.suppress(OSError, AttributeError):
                    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except Exception:
            os.close(saved)
            raise
        channel = _Channel(stream, fds, saved, read_fd, tty)
        try:
            for fd in fds:
                # Python's buffered sys.stdout has not written these bytes yet: they must reach
                # the fd they were meant for, not the capture (nor be lost).
                _flush_python_streams()
                os.dup2(write_fd, fd)  # inheritable: subprocesses write into the capture too
        except Exception:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.dup2(saved, fd)
            for fd in (read_fd, write_fd, saved):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        os.close(write_fd)  # fd 1 (and 2) hold the writing end now
        return channel

    def settle(self, timeout: float = SETTLE_SECONDS, finish: bool = False) -> bool:
        """Flush Python's own buffers and wait (at most ``timeout``) until the reader has taken
        everything written so far: the last lines before a probe closes reach the console.
        ``finish``: an unfinished line (``no newline at exit``) is kept as a line too."""
        thread = self._thread
        if not self.running or thread is None or not thread.is_alive() or os.getpid() != self._pid:
            return False
        _flush_python_streams()
        self._finish_open = finish
        self._settled.clear()
        self._settle.set()
        self._wake()
        return self._settled.wait(timeout)

    def stop(self, timeout: float = SETTLE_SECONDS) -> None:
        """Give fds 1 and 2 back to what they were; what was written before reaches the terminal
        (the reader goes on draining until every writer, a forked worker too, has let go)."""
        if not self.running or os.getpid() != self._pid:
            return
        self.settle(timeout, finish=True)
        self.running = False
        self._stopping = True
        self._restore()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def forget_after_fork(self) -> None:
        """In a forked child: it writes into the parent's capture, read by the parent's thread;
        it owns nothing (no thread, no restoring)."""
        self.running = False
        self._thread = None

    def _restore(self) -> None:
        for channel in self._channels:
            if channel.restored:
                continue
            channel.restored = True
            for fd in channel.fds:
                with contextlib.suppress(OSError):
                    os.dup2(channel.saved, fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # --- the reader thread -----------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            self._pump()
        except BaseException as exc:  # never leave the writers on a pipe nobody reads
            self.failed = f"{type(exc).__name__}: {exc}"
            self.running = False
            self._restore()
            self._drain_blind()
        finally:
            self._settled.set()

    def _pump(self) -> None:
        poller = select.poll()
        by_fd = {c.read_fd: c for c in self._channels}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        next_winsize = 0.0
        while by_fd:
            settling = self._settle.is_set()
            ready = poller.poll(0 if settling else WINSIZE_SECONDS * 1000)
            got = short = False
            for fd, _ in ready:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 512)
                    continue
                channel = by_fd[fd]
                try:
                    data = os.read(fd, READ_BYTES)
                except OSError:  # EIO: a pty whose every writer closed
                    data = b""
                if not data:
                    poller.unregister(fd)
                    del by_fd[fd]
                    self._finish(channel)
                    continue
                got = True
                short = short or (not channel.tty and len(data) < BATCH_BYTES)
                _write_all(channel.saved, data)  # the terminal first, as it was
                self._take(channel, data)
            if not got and settling:
                if self._finish_open:
                    for channel in by_fd.values():
                        if channel.pending:
                            self._take(channel, b"\n")
                self._settle.clear()
                self._settled.set()
            if not ready and not self._stopping:
                next_winsize = self._follow_winsize(next_winsize)
            elif short and not settling and not self._stopping:
                # A pipe (1 MiB: far more than a millisecond of any flood) that had little in
                # it: let more gather. Waking for each of a flood's writes takes the GIL from
                # the writer each time (measured: 17,000 switches for 100,000 lines). Not a
                # pty: its buffer is small, and a writer waiting on it would be slowed.
                time.sleep(BATCH_SECONDS)

    def _follow_winsize(self, due: float) -> float:
        now = time.monotonic()
        if now >= due:
            for channel in self._channels:
                if channel.tty and not channel.restored:
                    with contextlib.suppress(OSError):
                        _copy_winsize(channel.saved, channel.read_fd)
        return now + WINSIZE_SECONDS

    def _finish(self, channel: _Channel) -> None:
        """Every writer let go of a channel: its last unfinished line is a line."""
        if channel.pending:
            self._take(channel, b"\n")
        channel.open = False
        for fd in (channel.read_fd, channel.saved):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _take(self, channel: _Channel, data: bytes) -> None:
        """Keep the complete lines of what was read, as one chunk (C-level work only)."""
        stream = channel.stream
        joined = channel.pending + data
        end = joined.rfind(b"\n")
        if end < 0:
            channel.pending = _tail(joined)
            with self._lock:
                self.open[stream] = last_state(channel.pending)
                self.revision += 1
            return
        body = joined[: end + 1]
        channel.pending = rest = _tail(joined[end + 1 :])
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

    def _drain_blind(self) -> None:
        """After a failure: pump bytes through, nothing kept, until every writer let go."""
        for channel in self._channels:
            if not channel.open:
                continue
            with contextlib.suppress(OSError):
                while data := os.read(channel.read_fd, READ_BYTES):
                    _write_all(channel.saved, data)

    # --- reading the ring (any thread) -----------------------------------------------------
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


def _copy_winsize(source: int, target: int) -> None:
    size = fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8)
    fcntl.ioctl(target, termios.TIOCSWINSZ, size)


def _write_all(fd: int, data: bytes) -> None:
    """Every byte to ``fd``; a closed terminal (EPIPE, EIO) loses the bytes, never the reader."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # the original was non-blocking: wait for room, as a writer would
            select.select([], [fd], [], 1.0)
            continue
        except InterruptedError:
            continue
        except OSError:
            return
        view = view[n:]


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


_tee: ConsoleTee | None = None


def capture(pin: bool = False) -> ConsoleTee | None:
    """The process's one capture, started on first use, for one more user (a probe, which
    :func:`release` s it when it closes; ``pin``: ``tdbg run``'s preload, held until exit);
    None where it could not start. Whatever holds it, it is given back at exit."""
    global _tee
    if _tee is not None and (_tee._pid != os.getpid() or not _tee.running):
        _tee = None  # a forked child (the parent's capture is not its own), or given back
    if _tee is None:
        tee = ConsoleTee()
        if not tee.start():
            return None
        _tee = tee
        import atexit

        atexit.register(tee.stop)
    if pin:
        _tee.pinned = True
    else:
        _tee.users += 1
    return _tee


def release(tee: ConsoleTee) -> None:
    """A probe closed: the fds are given back when no probe (nor ``tdbg run``) holds the capture."""
    if os.getpid() != tee._pid:
        return
    tee.users -= 1
    if tee.users <= 0 and not tee.pinned:
        tee.stop()  # the last lines, an unfinished one too, reach the probe's final tick
    else:
        tee.settle(finish=True)


def current() -> ConsoleTee | None:
    """The capture running in this process, if any (never starts one)."""
    return _tee if _tee is not None and _tee._pid == os.getpid() else None


def _after_fork_in_child() -> None:
    if _tee is not None:
        _tee.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
