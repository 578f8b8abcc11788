"""``tdbg bridge --job JOB --summaries``: this node's ranks read here and sent as node summaries.

The bridge is a client of every rank of the job on this node: one reader thread per rank hands
what it decodes to one folding thread, which keeps each rank's ``RunState`` and, SUMMARY_HZ times
a second, sends one ``summary`` (model/node_reduce.py). A rank's full probe stream crosses the
node stream only while the viewer subscribes to it: ``subscribe`` opens a channel exactly as
the plain ``--job`` bridge opens one for every rank (a second connection to the probe, its
bytes relayed untouched), and the viewer's ``close`` ends it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tdbg.cli.bridge_job import JobBridge
from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.exit_status import exit_status
from tdbg.connect.jobs import job_entries
from tdbg.connect.runtime import RunEntry, discover
from tdbg.connect.waiting import wait_set
from tdbg.model.node_reduce import NodeCache, reduce_node
from tdbg.model.run_state import RunState
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages import node_notice
from tdbg.protocol.messages.node_summary import read_subscribe
from tdbg.protocol.step_runs import coalesced

SUMMARY_HZ = 2.0  # node summaries a second: the viewer's figures are at most this old
# Seconds before a rank whose connection or handshake failed is tried again; doubles up to the
# cap. A busy node (a 1,024-rank simulation on 2 cores: load 80) can take longer than the
# handshake's 5 s to answer; untried again, such a rank was never read, and a node whose ranks
# all failed never sent a summary.
RETRY_START = 1.0
RETRY_CAP = 10.0
RESCAN_EVERY = 20  # looks (10 s) between full reads of the runtime directory, changed or not


class SummaryBridge(JobBridge):
    """A ``JobBridge`` that reads its ranks itself and sends summaries; channels on request."""

    def __init__(self, job: str, directory: Path, outfd: int) -> None:
        super().__init__(job, directory, outfd)
        self.host = socket.gethostname()
        self.states: dict[int, RunState] = {}  # the folding thread's alone
        self._inbox: queue.SimpleQueue[tuple[int, int, dict[str, Any] | None]] = queue.SimpleQueue()
        self._readers: dict[int, tuple[int, ProbeClient]] = {}  # rank -> (pid, its client)
        self._tried: set[tuple[int, int]] = set()  # (rank, pid) connected to, or trying
        # (rank, pid) whose try failed -> (when to try again, the wait after that)
        self._retry: dict[tuple[int, int], tuple[float, float]] = {}
        self._entries: dict[int, RunEntry] = {}  # rank -> its newest run here
        self._names_sent: str | None = None  # the layout whose layer names the viewer has
        self._windows_sent: dict[int, int] = {}  # rank -> the end of its last window sent
        self._cache = NodeCache()  # what a summary read that the next need not read again
        self.summaries = 0  # sent (tests and the benchmark read it)
        self._names: frozenset[str] | None = None  # the runtime directory's, at the last look
        self._looks = 0

    def start(self) -> None:
        super().start()  # the preamble, the hello and the discovery thread (look())
        threading.Thread(target=self._fold, name="bridge-summary", daemon=True).start()

    def look(self) -> None:
        """Read every rank of the job here not read yet (a restart is a new pid); each rank is
        connected to on a thread of its own, so 64 handshakes wait on each other in no way."""
        if not self._changed():
            return
        ranks = job_entries(discover(self.directory)).get(self.job, {})
        for rank, entry in sorted(ranks.items()):
            self._entries[rank] = entry
            key = (rank, entry.pid)
            if key in self._tried:
                continue
            with self._lock:
                again = self._retry.get(key)
            if again is not None and time.monotonic() < again[0]:
                continue
            self._tried.add(key)
            threading.Thread(
                target=self._attach, args=(rank, entry), name=f"bridge-r{rank}", daemon=True
            ).start()

    def _changed(self) -> bool:
        """Whether the runtime directory may hold a run not seen yet: its names changed since
        the last look, a rank's retry is due, or RESCAN_EVERY looks passed. Reading every
        run's metadata twice a second was a sixth of an idle bridge's CPU."""
        try:
            names = frozenset(os.listdir(self.directory))
        except OSError:
            names = frozenset()
        self._looks += 1
        with self._lock:
            due = any(at <= time.monotonic() for at, _ in self._retry.values())
        if names == self._names and not due and self._looks % RESCAN_EVERY:
            return False
        self._names = names
        return True

    def _attach(self, rank: int, entry: RunEntry) -> None:
        key = (rank, entry.pid)
        try:
            client = ProbeClient.connect(entry.socket)
        except ConnectError as exc:
            with self._lock:
                first = key not in self._retry
                wait = RETRY_START if first else self._retry[key][1]
                self._retry[key] = (time.monotonic() + wait, min(wait * 2, RETRY_CAP))
            self._tried.discard(key)  # look() tries it again once the wait is over
            if first:  # said once: the rank may answer on a later try
                self.write(node_notice(f"rank {rank} (pid {entry.pid}): {exc}; retrying"))
            return
        with self._lock:
            self._retry.pop(key, None)
            old = self._readers.get(rank)
            self._readers[rank] = (entry.pid, client)
        if old is not None:
            with contextlib.suppress(OSError):
                old[1].sock.shutdown(socket.SHUT_RDWR)
        self._inbox.put((rank, entry.pid, {"type": "hello", **client.run}))
        self._read(rank, entry.pid, client)

    def _read(self, rank: int, pid: int, client: ProbeClient) -> None:
        why = "connection closed"
        said_bye = False
        try:
            for message in client.messages():
                if message.get("type") == "bye":
                    said_bye = True
                    why = str(message.get("reason") or "closed")
                self._inbox.put((rank, pid, message))
        except (OSError, ProtocolError) as exc:
            why = f"connection lost: {exc}"
        if not said_bye and not self.done.is_set():
            why = exit_status(pid) or why  # no goodbye: the process died (it is on this host)
        self._inbox.put((rank, pid, {"type": "bye", "reason": why}))
        client.close()

    def _fold(self) -> None:
        """Fold what the ranks sent into their states; send a summary every 1/SUMMARY_HZ s."""
        period = 1.0 / SUMMARY_HZ
        due = time.monotonic() + period
        pids: dict[int, int] = {}
        synced: set[int] = set()  # ranks whose history has all arrived (until the first summary)
        # Each rank's messages since the last summary, folded just before the next one: a run
        # of step batches is folded as one (at 10 steps/s a rank sends 5 a summary, and each
        # fold has a fixed cost of ~70 µs).
        unfolded: dict[int, list[dict[str, Any]]] = {}
        while not self.done.is_set():
            try:
                rank, pid, message = self._inbox.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                message = None
            if message is not None:
                if message.get("type") == "hello":
                    run = {k: v for k, v in message.items() if k != "type"}
                    self.states[rank] = RunState(run)
                    self.states[rank].mark("live")
                    pids[rank] = pid
                    unfolded.pop(rank, None)  # the old run's: its state is gone
                    self._windows_sent.pop(rank, None)  # a new run of the rank: its own windows
                elif rank in self.states and pids.get(rank) == pid:  # not an old run's tail
                    unfolded.setdefault(rank, []).append(message)
                    if message.get("type") == "synced" and not self.summaries:
                        # The first summary goes as soon as every rank found has sent its
                        # history, not a tick later: the viewer's first frame waits for it.
                        synced.add(rank)
                        if synced >= set(self._entries):
                            due = time.monotonic()
            if time.monotonic() >= due:
                due = time.monotonic() + period
                self._fold_in(unfolded)
                self._summarise()

    def _fold_in(self, unfolded: dict[int, list[dict[str, Any]]]) -> None:
        """Fold each rank's messages since the last summary into its state, in order."""
        for rank, messages in unfolded.items():
            state = self.states[rank]
            for message in coalesced(messages):
                state.apply(message)
                if message.get("type") == "bye":
                    state.mark("ended", str(message.get("reason") or "closed"))
        unfolded.clear()

    def _summarise(self) -> None:
        if not self.states:
            return
        summary = reduce_node(
            self.host,
            self.job,
            self.states,
            self._names_sent,
            windows_sent=self._windows_sent,
            cache=self._cache,
        )
        if summary.grads is not None:
            self._names_sent = summary.grads.layout
        for figures in summary.ranks:
            if figures.windows:
                self._windows_sent[figures.rank] = figures.windows[-1].end
        self.write(summary.to_wire())
        self.summaries += 1

    # --- client -> bridge: subscriptions ------------------------------------------------------
    def _read_client(self, raw: Any) -> None:
        rank = read_subscribe(raw)
        if rank is None:
            super()._read_client(raw)
            return
        entry = self._entries.get(rank)
        if entry is None:
            self.write(node_notice(f"rank {rank} is not on this node"))
            return
        self._open((rank, entry.pid), entry)

    def close(self) -> None:
        super().close()
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for _, client in readers:
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_RDWR)


def serve_summaries(job: str, directory: Path, infd: int, outfd: int) -> int:
    """Serve job ``job``'s ranks in ``directory`` as summaries until the client closes."""
    bridge = SummaryBridge(job, directory, outfd)
    bridge.start()
    reader = threading.Thread(target=bridge.upstream, args=(infd,), name="bridge-up", daemon=True)
    reader.start()
    wait_set(bridge.done)
    bridge.close()
    return 0
