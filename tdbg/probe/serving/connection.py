"""One client connection as the probe's server sees it: buffers, deadlines, limits."""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tdbg.protocol.framing import MAX_INBOUND_FRAME, Decoder, pack

SOFT_LIMIT = 1 << 20  # bytes unread by a client...
SOFT_LIMIT_SECONDS = 10.0  # ...while it takes nothing for this long makes it a slow consumer
HARD_LIMIT = 8 << 20  # bytes queued: a slow consumer at once
HANDSHAKE_SECONDS = 5.0
FRAME_SECONDS = 10.0  # a started frame must complete in this time (slowloris)
REPLAY_SECONDS = 120.0  # a late client must take the history within this time
RATE_PER_S = 20.0
RATE_BURST = 40.0
ERRORS_PER_MINUTE = 10
RATE_LIMITED_PER_MINUTE = 200  # refusals a client may collect before it is dropped
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


class TokenBucket:
    """20 commands/s, burst 40 — one per peer process, kept across its reconnects (a client
    that reconnects to get a fresh bucket gets the one it emptied)."""

    def __init__(self) -> None:
        self.tokens = RATE_BURST
        self.refilled = time.monotonic()
        self.limited_times: deque[float] = deque()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(RATE_BURST, self.tokens + (now - self.refilled) * RATE_PER_S)
        self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Connection:
    """Outbound data flows: ``backlog`` (history replay and anything queued behind it, packed
    lazily) -> ``outbuf`` (encoded bytes) -> the kernel. Only ``outbuf`` and live messages count
    against the slow-consumer limits, so a long history never gets a healthy client dropped.

    Every frame enters ``outbuf`` through :meth:`append`, which remembers where it ends: a
    goodbye can then cut what is queued at a frame boundary, so a dropped client reads complete
    frames and then the ``bye`` saying why — not megabytes of stale data first."""

    def __init__(self, sock: socket.socket, peer_pid: int) -> None:
        self.sock = sock
        self.peer_pid = peer_pid
        self.decoder = Decoder(MAX_INBOUND_FRAME)
        self.accepted_at = time.monotonic()
        self.frame_started: float | None = None
        self.handshaken = False
        self.replaying = False
        self.replay_started = 0.0
        self.backlog: deque[Mapping[str, Any] | bytes] = deque()
        self.backlog_live_bytes = 0  # live frames waiting behind the replay: they count
        self.outbuf = bytearray()
        self.sent = 0  # bytes the kernel took, ever
        self.appended = 0  # bytes put in outbuf, ever
        self.frame_ends: deque[int] = deque()  # where each frame in outbuf ends (in appended)
        self.last_progress = time.monotonic()  # when the client last took a byte
        self.over_soft_since: float | None = None
        self.closing_until: float | None = None  # dropped: its goodbye goes out until then
        self.error_times: deque[float] = deque()
        self.bucket = TokenBucket()  # the server hands over the peer's own (see Buckets)
        self.dropped_messages = 0
        self.closed = False

    # --- outbound ---------------------------------------------------------------------------
    def append(self, frame: bytes) -> None:
        """One whole frame (or the preamble) into ``outbuf``."""
        self.outbuf += frame
        self.appended += len(frame)
        self.frame_ends.append(self.appended)

    def goodbye(self, frame: bytes) -> None:
        """Replace what is queued by ``frame`` (a ``bye``), after the frame being sent."""
        self.backlog.clear()
        self.replaying = False
        self.backlog_live_bytes = 0
        while self.frame_ends and self.frame_ends[0] <= self.sent:
            self.frame_ends.popleft()
        keep = (self.frame_ends[0] - self.sent) if self.frame_ends else 0
        del self.outbuf[keep:]
        self.appended = self.sent + len(self.outbuf)
        self.frame_ends.clear()
        if keep:
            self.frame_ends.append(self.appended)
        self.append(frame)

    def queue(self, frame: bytes) -> None:
        if self.replaying:
            self.backlog.append(frame)
            self.backlog_live_bytes += len(frame)
        else:
            self.append(frame)

    def start_replay(self, messages: Sequence[Mapping[str, Any]]) -> None:
        self.replaying = True
        self.replay_started = time.monotonic()
        self.backlog.extend(messages)

    def refill_from_backlog(self) -> None:
        while self.backlog and len(self.outbuf) < SOFT_LIMIT // 2:
            item = self.backlog.popleft()
            self.append(item if isinstance(item, bytes) else pack(item))
        if not self.backlog:
            self.replaying = False
            self.backlog_live_bytes = 0

    def flush(self) -> bool:
        """Send what the kernel takes now; False when the peer is gone."""
        self.refill_from_backlog()
        while self.outbuf:
            try:
                sent = self.sock.send(self.outbuf, SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:  # EPIPE, ECONNRESET: a disconnect, not an error
                return False
            del self.outbuf[:sent]
            if sent:
                self.sent += sent
                self.last_progress = time.monotonic()
                while self.frame_ends and self.frame_ends[0] <= self.sent:
                    self.frame_ends.popleft()
            self.refill_from_backlog()
        return True

    @property
    def wants_write(self) -> bool:
        return bool(self.outbuf or self.backlog)

    def slow_consumer(self, now: float) -> bool:
        """Too much unread: over HARD_LIMIT at once; over SOFT_LIMIT for SOFT_LIMIT_SECONDS
        while the client took nothing; or a history it would not take in REPLAY_SECONDS.
        During a replay the history itself does not count, only live frames waiting behind it
        (a long history never gets a healthy client dropped)."""
        if self.replaying:
            unread = self.backlog_live_bytes
            if now - self.replay_started > REPLAY_SECONDS:
                return True
        else:
            unread = len(self.outbuf)
        if unread > HARD_LIMIT:
            return True
        stuck = self.outbuf and now - self.last_progress > SOFT_LIMIT_SECONDS
        if unread > SOFT_LIMIT:
            if self.over_soft_since is None:
                self.over_soft_since = now
            return bool(stuck) or now - self.over_soft_since > SOFT_LIMIT_SECONDS
        self.over_soft_since = None
        # A client that takes nothing at all while its live data piles up during a replay.
        return bool(self.replaying and stuck and self.backlog_live_bytes > SOFT_LIMIT // 4)

    # --- inbound limits ---------------------------------------------------------------------
    def take_token(self) -> bool:
        """The peer's token bucket: 20 commands/s, burst 40."""
        return self.bucket.take()

    def count_error(self) -> bool:
        """Record a protocol error; True when the connection has made too many this minute."""
        return _over(self.error_times, ERRORS_PER_MINUTE)

    def count_rate_limited(self) -> bool:
        """Record a rate-limit refusal; True when a client ignores them (sustained flooding)."""
        return _over(self.bucket.limited_times, RATE_LIMITED_PER_MINUTE)

    def timed_out(self, now: float) -> str | None:
        if not self.handshaken and now - self.accepted_at > HANDSHAKE_SECONDS:
            return "no hello within 5 s"
        if self.decoder.mid_frame:
            if self.frame_started is None:
                self.frame_started = now
            elif now - self.frame_started > FRAME_SECONDS:
                return "frame not completed within 10 s"
        else:
            self.frame_started = None
        return None

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


def _over(times: deque[float], per_minute: int) -> bool:
    """Add now to a sliding one-minute window; True when it holds more than ``per_minute``."""
    now = time.monotonic()
    times.append(now)
    while times and now - times[0] > 60.0:
        times.popleft()
    return len(times) > per_minute


class Buckets:
    """The token buckets of the last MAX_PEERS peer processes, by pid."""

    MAX_PEERS = 256

    def __init__(self) -> None:
        self._by_pid: dict[int, TokenBucket] = {}

    def of(self, pid: int) -> TokenBucket:
        bucket = self._by_pid.pop(pid, None) or TokenBucket()
        self._by_pid[pid] = bucket  # most recent last
        while len(self._by_pid) > self.MAX_PEERS:
            del self._by_pid[next(iter(self._by_pid))]
        return bucket
