"""Where events come from: a probe's socket, auto-discovered runs, or a replayed message list.

A source is driven from one worker thread (see ``app.py``) through three blocking calls:
``open()`` attaches, ``batches()`` yields lists of messages until the run's connection ends, and
``reattach()`` waits for the same run to come back (a restart) and attaches to it. The UI thread
only ever calls ``choose()``, ``send()`` and ``stop()``.

``send(command, **args)`` is the one way back to the probe (deep-dive commands). It runs on the
UI thread while the worker reads the same socket, so sends are serialised by a lock; it never
raises: it returns the message id, or None with ``send_error`` saying why (read-only source,
not connected, connection lost).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from textual.message import Message

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.runtime import RunEntry, WaitingNote, discover, waiting_for_run
from tdbg.protocol.framing import ProtocolError

POLL_INTERVAL = 0.5  # seconds between discovery polls while waiting for a run
MAX_BATCH = 4096  # messages handed to the UI at once; a full replay arrives in a few batches
# Seconds: reading what a run sent on attaching, before the first frame, stops once the socket
# is quiet this long (a run at 20 steps/s sends every 50 ms), or after ARRIVED_MOST in all.
ARRIVED_IDLE = 0.02
ARRIVED_MOST = 0.1


class SourceMessage(Message):
    """A message about a source, posted from the app's reading worker. ``origin`` is the source
    it came from (that worker sets it): after a switch of runs, what the old source's worker
    still posts is dropped by it, not folded into the new run."""

    origin: Source | None = None


Notify = Callable[[SourceMessage], object]  # how a source's blocking calls tell the app something


class Stoppable:
    """A source's stop flag: the UI thread asks the worker's blocking calls to return soon."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask blocking calls to return soon; called from the UI thread on exit."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self.stop()


class Source(Stoppable):
    """The interface the app's worker drives. Subclasses override what they support.

    What a source has to tell the app while it attaches or reattaches, it passes to ``notify``
    as one of the messages below; the app handles each by its type.
    """

    class WaitStarted(SourceMessage):
        """No run to attach to yet: the source waits for one to start ``where``."""

        def __init__(self, where: str) -> None:
            super().__init__()
            self.where = where

    class RunsOffered(SourceMessage):
        """Several runs are there: the user picks one (``Source.choose``), or none."""

        def __init__(self, entries: Sequence[RunEntry]) -> None:
            super().__init__()
            self.entries = list(entries)

    class ReconnectStarted(SourceMessage):
        """The run came back (or the link dropped): the source is attaching to ``run`` again."""

        def __init__(self, run: str) -> None:
            super().__init__()
            self.run = run

    class WarningRaised(SourceMessage):
        """Something the user should know that does not stop the source (a run that went away
        before it could be attached, a node that did not answer)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    watches_for_restart = False  # True when reattach() waits for a restarted run
    read_only_reason: str | None = "this source is read-only (a replay): it cannot send commands"

    def __init__(self) -> None:
        super().__init__()
        self.run: dict[str, Any] = {}
        self.label = ""
        self.end_reason: str | None = None
        self.send_error: str | None = None  # why the last send() returned None
        self._send_lock = threading.Lock()
        self._choice: queue.SimpleQueue[RunEntry | None] = queue.SimpleQueue()  # the picker's

    def send(self, command: str, **args: Any) -> int | None:
        """Send a command to the probe; its id, or None with ``send_error`` set. Never raises."""
        with self._send_lock:
            self.send_error = None
            try:
                mid = self._send(command, args)
            except (OSError, ProtocolError, ValueError) as exc:
                mid = None
                self.send_error = f"could not send {command}: {exc}"
            if mid is None and self.send_error is None:
                self.send_error = self.read_only_reason or f"could not send {command}"
            return mid

    def _send(self, command: str, args: dict[str, Any]) -> int | None:
        """Subclasses that can talk back send here (the lock is held); None = cannot."""
        return None

    def open(self, notify: Notify) -> None:
        """Attach (blocking); ``notify`` tells the app of a wait, a choice or a warning."""

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        """Yield message batches until the connection ends."""
        return iter(())

    def arrived(self) -> list[dict[str, Any]]:
        """What an attached source has already received, read without waiting for more (the
        data painted after the first frame); ``batches()`` goes on after it. Nothing for most
        sources."""
        return []

    def reattach(self, notify: Notify) -> bool:
        """Wait for the run to come back and attach; False when this source cannot."""
        return False

    def choose(self, entry: RunEntry | None) -> None:
        """The user picked a run (None = give up); only sources that show the picker ask."""
        self._choice.put(entry)

    def _await_choice(self) -> RunEntry | None:
        """Block (in the worker) until the user picks a run after ``RunsOffered``; None
        when they gave up (the source is then stopped) or the source was stopped meanwhile."""
        while not self.stopped:
            try:
                entry = self._choice.get(timeout=0.25)
            except queue.Empty:
                continue
            if entry is None:
                self.stop()
            return entry
        return None


class ReplaySource(Source):
    """A fixed list of messages, for tests and demos.

    ``batch_size`` splits them into several batches (None = one batch). With ``end=False`` the
    connection stays "live" after the replay instead of ending, as a quiet run would.
    """

    def __init__(
        self,
        messages: list[dict[str, Any]],
        run: dict[str, Any] | None = None,
        batch_size: int | None = None,
        end: bool = True,
        end_reason: str = "shutdown",
    ) -> None:
        super().__init__()
        self.messages = list(messages)
        self.run = dict(run or {"name": "replay", "pid": 0, "host": "replay"})
        self.label = "replay"
        self.batch_size = batch_size or max(1, len(self.messages))
        self.end = end
        self._end_reason = end_reason
        self.replayed = threading.Event()

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        for i in range(0, len(self.messages), self.batch_size):
            if self.stopped:
                return
            yield self.messages[i : i + self.batch_size]
        self.replayed.set()
        if not self.end:
            self._stop.wait()
        self.end_reason = self._end_reason


class SocketSource(Source):
    """A probe's Unix socket. Pass an already connected ``client`` to skip the first connect.

    When the run ends it waits (polling discovery) for a run with the same name and a new pid or
    start time — a restarted job — and attaches to that.
    """

    watches_for_restart = True
    read_only_reason = None

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        client: ProbeClient | None = None,
        directory: Path | None = None,
    ) -> None:
        super().__init__()
        if path is None and client is None:
            raise ValueError("SocketSource needs a path or a connected client")
        if path is not None:
            self.path = os.fspath(path)
        else:
            assert client is not None
            self.path = str(client.run.get("socket", ""))
        self.directory = directory
        self.client = client
        if client is not None:
            self.run = dict(client.run)
        self.label = self.path

    def open(self, notify: Notify) -> None:
        if self.client is None:
            self._attach(ProbeClient.connect(self.path))

    def _send(self, command: str, args: dict[str, Any]) -> int | None:
        client = self.client
        if client is None or client.closed or client.peer_closed:
            why = self.end_reason or "not attached to a run"
            self.send_error = f"not connected ({why}): {command} not sent"
            return None
        return client.send(command, **args)

    def _close_client(self, client: ProbeClient) -> None:
        with self._send_lock:  # close() sends a bye: never interleave it with a command
            client.close()

    def _attach(self, client: ProbeClient) -> None:
        if self.client is not None and self.client is not client:
            self._close_client(self.client)
        self.client = client
        self.run = dict(client.run)
        self.end_reason = None
        if client.run.get("socket"):
            self.path = str(client.run["socket"])
            self.label = self.path

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        client = self.client
        if client is None:
            return
        # ProbeClient.messages() yields one message at a time and blocks in recv between
        # chunks; a reader thread feeds a queue so this side can hand the UI everything that
        # has arrived as one batch instead of one message per post.
        inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()

        def reader() -> None:
            try:
                for message in client.messages():
                    inbox.put(message)
            except Exception as exc:  # a protocol error ends the connection, reported below
                inbox.put({"type": "error", "code": "CLIENT", "message": str(exc)})
            finally:
                inbox.put(None)

        thread = threading.Thread(target=reader, name="tdbg-reader", daemon=True)
        thread.start()
        done = False
        while not done and not self.stopped:
            try:
                first = inbox.get(timeout=0.25)
            except queue.Empty:
                continue
            batch: list[dict[str, Any]] = []
            item: dict[str, Any] | None = first
            while True:
                if item is None:
                    done = True
                    break
                batch.append(item)
                if item.get("type") == "bye":
                    self.end_reason = str(item.get("reason") or "closed")
                if len(batch) >= MAX_BATCH:
                    break
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
            if batch:
                yield batch
        self._close_client(client)
        if self.end_reason is None:
            self.end_reason = "connection closed"

    def arrived(self) -> list[dict[str, Any]]:
        """The run's history as the probe sent it on attaching (already in the socket by the
        time the app mounts), read until the socket is quiet for ARRIVED_IDLE or ARRIVED_MOST
        has passed: the app paints it right after its first frame instead of waiting for the
        reader thread to start, read and post it. Called before the reader starts (one reader
        only)."""
        client = self.client
        if client is None or client.closed or client.peer_closed:
            return []
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + ARRIVED_MOST
        try:
            for message in client.messages(timeout=ARRIVED_IDLE):
                out.append(message)
                if message.get("type") == "bye":  # as batches() would have read it
                    self.end_reason = str(message.get("reason") or "closed")
                if len(out) >= MAX_BATCH or time.monotonic() > deadline:
                    break
        except Exception as exc:  # a protocol error: batches() reports the end of the connection
            out.append({"type": "error", "code": "CLIENT", "message": str(exc)})
            client.peer_closed = True
        return out

    def _candidates(self) -> list[RunEntry]:
        return discover(self.directory)

    def reattach(self, notify: Notify) -> bool:
        name = self.run.get("name")
        old = (self.run.get("pid"), self.run.get("start_time"))
        same_process_may_return = self.end_reason not in ("shutdown",)
        while not self.stopped:
            for entry in self._candidates():
                if entry.name != name:
                    continue
                new = (entry.meta.get("pid"), entry.meta.get("start_time"))
                if new == old and not same_process_may_return:
                    continue
                notify(self.ReconnectStarted(entry.describe()))
                try:
                    client = ProbeClient.connect(entry.socket)
                except ConnectError:
                    continue
                self._attach(client)
                return True
            self._stop.wait(POLL_INTERVAL)
        return False

    def close(self) -> None:
        super().close()
        if self.client is not None:
            # Shutting the socket down wakes the reader thread blocked in recv.
            with contextlib.suppress(OSError):
                self.client.sock.shutdown(2)
            self._close_client(self.client)


class DiscoverySource(SocketSource):
    """No target given: wait for a run to appear, let the user pick one when there are several."""

    def __init__(self, directory: Path | None = None) -> None:
        Source.__init__(self)
        self.path = ""
        self.directory = directory
        self.client = None
        self.label = "discovery"

    def open(self, notify: Notify) -> None:
        # Noted as waiting until attached (connect/runtime.py): a run that ends before the next
        # look (a busy machine) serves on a moment for this source. Not while the picker is
        # up: a person choosing among runs must not hold every run's exit.
        with waiting_for_run(self.directory) as note:
            self._open(notify, note)

    def _open(self, notify: Notify, note: WaitingNote) -> None:
        announced: list[str] | None = None
        while not self.stopped:
            entries = self._candidates()
            if len(entries) == 1:
                with contextlib.suppress(ConnectError):
                    self._attach(ProbeClient.connect(entries[0].socket))
                    return
            elif len(entries) > 1:
                note.take()  # no note while the person picks
                notify(self.RunsOffered(entries))
                entry = self._await_choice()
                if entry is None:
                    return  # gave up or stopped: the worker ends quietly either way
                try:
                    self._attach(ProbeClient.connect(entry.socket))
                    return
                except ConnectError as exc:
                    notify(self.WarningRaised(str(exc)))
                note.put()  # waiting again
                announced = None
                continue
            if announced is None:
                notify(self.WaitStarted(str(self.directory or "")))
                announced = []
            self._stop.wait(POLL_INTERVAL)
        raise ConnectError("stopped while waiting for a run")
