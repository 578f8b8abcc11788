"""Every rank of one job on this machine: the runs sharing a job id, each read on its own thread.

The app's worker calls ``open()`` (blocks until a rank of the job is found) and then iterates
``batches()``, which yields ``{rank: [messages]}`` with what has arrived from every rank, and
picks up ranks that start later. ``send(rank, command, **args)`` goes to one rank's probe.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from textual.message import Message

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.exit_status import exit_status
from tdbg.connect.jobs import job_entries
from tdbg.connect.runtime import discover
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.tui.sources.base import Stoppable

POLL_INTERVAL = 0.5  # seconds between looks for ranks that started later
MAX_BATCH = 4096  # messages handed to the UI at once

Notify = Callable[[Message], object]  # how the source's threads tell the app something
RankBatches = dict[int, list[dict[str, Any]]]

__all__ = ["JobSource", "Notify", "RankBatches", "job_entries"]


class JobSource(Stoppable):
    """The ranks of job ``job`` (None: the only job found, or the one with most ranks).

    What it has to tell the app, it passes to ``notify`` as one of the messages below; the app
    handles each by its type.
    """

    class WaitStarted(Message):
        """No rank of the job is there yet: the source waits for ``what``."""

        def __init__(self, what: str) -> None:
            super().__init__()
            self.what = what

    class NodesChecked(Message):
        """The nodes that are not read (and a tdbg version mismatch), one line each; sent
        whenever the lines change, an empty list once every node is read."""

        def __init__(self, lines: list[str]) -> None:
            super().__init__()
            self.lines = lines

    class WarningRaised(Message):
        """Something the user should know that does not stop the source (a rank that could
        not be attached, a node's notice)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, job: str | None = None, directory: Path | None = None) -> None:
        super().__init__()
        self.job = job
        self.directory = directory
        self.label = f"job {job}" if job else "job"
        self.runs: dict[int, dict[str, Any]] = {}  # rank -> its hello's run description
        self.ended: dict[int, str] = {}  # rank -> why its connection ended
        self._clients: dict[int, ProbeClient] = {}
        self._inbox: queue.SimpleQueue[tuple[int, dict[str, Any] | None]] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        # Registering a rank's client and retiring it (with its hello and its end in the inbox)
        # happen under this lock, so a rank that comes back (a restart, a reconnected node)
        # never has its new client retired by the old one's end.
        self._rank_lock = threading.Lock()
        self.send_error: str | None = None
        # Read through node summaries (a large job): the app then subscribes to the ranks it
        # shows whole (sources/remote_job.py); a plain source reads every rank whole.
        self.aggregated = False

    def take_summaries(self) -> dict[str, NodeSummary]:
        """The nodes' summaries that arrived since the last call, by node (none here)."""
        return {}

    def subscribe(self, rank: int, node: str) -> bool:
        """Ask for rank ``rank``'s full stream (on ``node``); False when it cannot be asked."""
        return False

    def unsubscribe(self, rank: int) -> None:
        """Give rank ``rank``'s full stream back (its reader ends without a goodbye)."""
        with self._rank_lock:
            client = self._clients.pop(rank, None)
            self.runs.pop(rank, None)
        if client is not None:
            with contextlib.suppress(OSError):
                client.sock.shutdown(2)  # wakes its reader thread blocked in recv
            client.close()

    # --- the worker's side ---------------------------------------------------------------
    def open(self, notify: Notify) -> None:
        """Block until a rank of the job is attached; ConnectError when stopped first."""
        announced = False
        while not self._stop.is_set():
            if self._attach_new(notify):
                return
            if not announced:
                notify(
                    self.WaitStarted(
                        f"a rank of job {self.job}" if self.job else "a distributed job"
                    )
                )
                announced = True
            self._stop.wait(POLL_INTERVAL)
        raise ConnectError("stopped while waiting for the job's ranks")

    def batches(self) -> Iterator[RankBatches]:
        """What every rank sent since the last batch, until stopped; new ranks join as found."""
        next_look = 0.0
        import time

        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_look:
                next_look = now + POLL_INTERVAL
                self._attach_new(lambda message: None)
            try:
                rank, message = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            out: RankBatches = {}
            count = 0
            while True:
                if message is None:
                    out.setdefault(rank, []).append(
                        {"type": "bye", "reason": self.ended.get(rank, "connection closed")}
                    )
                else:
                    out.setdefault(rank, []).append(message)
                count += 1
                if count >= MAX_BATCH:
                    break
                try:
                    rank, message = self._inbox.get_nowait()
                except queue.Empty:
                    break
            yield out

    def _attach_new(self, notify: Notify) -> bool:
        """Connect to ranks of the job not read yet; True when any rank is attached."""
        jobs = job_entries(discover(self.directory))
        if self.job is None and jobs:
            self.job = max(jobs, key=lambda j: len(jobs[j]))
            self.label = f"job {self.job}"
        for rank, entry in sorted(jobs.get(self.job or "", {}).items()):
            known = self.runs.get(rank)
            fresh = known is None or known.get("pid") != entry.meta.get("pid")
            if rank in self._clients or not fresh:
                continue
            try:
                client = ProbeClient.connect(entry.socket)
            except ConnectError as exc:
                notify(self.WarningRaised(f"rank {rank}: {exc}"))
                continue
            self._register(rank, client)
            threading.Thread(
                target=self._read, args=(rank, client), name=f"tdbg-rank{rank}", daemon=True
            ).start()
        return bool(self._clients)

    def _register(self, rank: int, client: ProbeClient, **extra: Any) -> None:
        """``client`` is rank ``rank``'s connection now; the UI gets its hello (``extra`` added
        to the run's description: where it was reached)."""
        run = dict(client.run, **extra)
        with self._rank_lock:
            self._clients[rank] = client
            self.runs[rank] = run
            self.ended.pop(rank, None)
            self._inbox.put((rank, {"type": "hello", **run}))

    def _read(self, rank: int, client: ProbeClient) -> None:
        why = "connection closed"
        said_bye = False
        try:
            for message in client.messages():
                if message.get("type") == "bye":
                    said_bye = True
                    why = str(message.get("reason") or "closed")
                self._inbox.put((rank, message))
        except (OSError, ProtocolError, ConnectError) as exc:
            why = f"connection lost: {exc}"
        finally:
            # No goodbye: the process died. Its exit status, while its parent has not reaped
            # it (a pid means something only on the rank's own host: never for a rank reached
            # through a node's ssh stream, whatever that node calls itself).
            remote = bool(self.runs.get(rank, {}).get("node"))
            here = not remote and client.run.get("host") == socket.gethostname()
            died = here and not said_bye and not self.stopped
            status = exit_status(int(client.run.get("pid", -1))) if died else None
            if status is not None:
                why = status
            with self._rank_lock:
                if self._clients.get(rank) is client:  # not replaced meanwhile
                    del self._clients[rank]
                    self.ended[rank] = why
                    self._inbox.put((rank, None))

    # --- the UI thread's side --------------------------------------------------------------
    def send(self, rank: int, command: str, **args: Any) -> int | None:
        """Send a command to one rank's probe; its id, or None with ``send_error`` set."""
        with self._send_lock:
            self.send_error = None
            client = self._clients.get(rank)
            if client is None or client.closed or client.peer_closed:
                why = self.ended.get(rank, "not attached")
                self.send_error = f"rank {rank} is not connected ({why}): {command} not sent"
                return None
            try:
                return client.send(command, **args)
            except (OSError, ProtocolError, ValueError) as exc:
                self.send_error = f"could not send {command} to rank {rank}: {exc}"
                return None

    def close(self) -> None:
        self.stop()
        with self._send_lock:
            for client in list(self._clients.values()):
                with contextlib.suppress(OSError):
                    client.sock.shutdown(2)  # wakes its reader thread blocked in recv
                client.close()
            self._clients.clear()
