"""The run's console at the fd level (opt-in, ``TDBG_CONSOLE=fd``): fds 1 and 2 through a tee.

Each captured fd is replaced by the writing end of a pty (when it was a terminal, so that
``isatty()``, the window size and progress bars behave as before) or of a pipe (a file, a pipe:
not a terminal either). One daemon thread, ``tdbg-console``, reads the other end, writes every
byte through to the original fd first, then keeps the lines. C-level writes (torch's warnings,
NCCL, a child process, a forked worker) are caught as well as ``print``.

What it can lose (why it is not the default, :mod:`tdbg.probe.console_stream` is): the bytes a
process writes in its last moments before a fatal signal (a segfault, ``abort()``, SIGKILL) or
``os._exit()`` (faulthandler's traceback among them) sit in the pty or pipe, not yet read, and
die with the reader thread: neither the terminal nor the file gets them. A clean exit (the
script's end, ``sys.exit``, an uncaught exception) loses nothing: the last probe's close or
``atexit`` flushes and waits for the reader (at most 0.5 s).

What it costs the writer: the bytes are copied once more, off its thread; the ring drops its
oldest lines (counted by sequence number), so a slow reader of the ring never holds the reader
thread, and the reader never waits for anything but the terminal the writer waited for anyway.
When fds 1 and 2 are one file (one terminal, ``2>&1``) they share one channel, so their order on
the terminal is exactly the order written; stderr is told apart only when it goes elsewhere.
Nothing here imports torch.
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
from dataclasses import dataclass, field

from tdbg.probe.console_ring import RING_LINES, ConsoleRing

READ_BYTES = 1 << 16
PIPE_BYTES = 1 << 20  # a pipe's capacity raised where the kernel lets us: a burst never waits
SETTLE_SECONDS = 0.5  # how long closing waits for the reader to take what was written (R56)
WINSIZE_SECONDS = 1.0  # how often a pty's window size follows the real terminal's
BATCH_BYTES = 1 << 15  # a pipe's read shorter than this: the reader pauses BATCH_SECONDS
BATCH_SECONDS = 0.001
STDOUT, STDERR = 1, 2


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


class ConsoleTee(ConsoleRing):
    """Captures fds 1 and 2 of this process; ``since(seq)`` reads the lines from any thread."""

    kind = "fd"

    def __init__(self, ring_lines: int = RING_LINES) -> None:
        super().__init__(ring_lines)
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
        self._blind = False  # keeping the lines failed: bytes pass through, nothing kept
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
            try:
                self._pump()
            except Exception as exc:
                # Keeping the lines failed: the bytes still go through, in order, nothing kept,
                # until stop() gives the fds back. Giving them back here instead would let the
                # writes made after it reach the terminal before those still in the pipe.
                self.failed = f"{type(exc).__name__}: {exc}"
                self._blind = True
                self._pump()
        except BaseException as exc:  # never leave the writers on a pipe nobody reads
            self.failed = self.failed or f"{type(exc).__name__}: {exc}"
            self.running = False
            self._restore()
            self._drain_blind()
        finally:
            self._settled.set()

    def _pump(self) -> None:
        poller = select.poll()
        by_fd = {c.read_fd: c for c in self._channels if c.open}
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
                if not self._blind:
                    self._take(channel, data)
            if not got and settling:
                if self._finish_open and not self._blind:
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
        if channel.pending and not self._blind:
            self._take(channel, b"\n")
        channel.open = False
        for fd in (channel.read_fd, channel.saved):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _drain_blind(self) -> None:
        """After a failure: pump bytes through, nothing kept, until every writer let go."""
        for channel in self._channels:
            if not channel.open:
                continue
            with contextlib.suppress(OSError):
                while data := os.read(channel.read_fd, READ_BYTES):
                    _write_all(channel.saved, data)


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
