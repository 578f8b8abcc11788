"""RemoteSource: runs on other machines, reached with the system ssh and ``tdbg bridge``.

Discovery lists the runs of every node (``ssh host tdbg bridge --list``, one thread per node)
for the picker. A connection that drops (ssh dies, the network goes) is retried with
exponential backoff; the probe replays its whole history to every new connection, so the app
starts from an empty state and nothing is lost or counted twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.runtime import RunEntry
from tdbg.connect.ssh import (
    TERM_GRACE,
    RemoteError,
    RemoteListing,
    RemoteOptions,
    SshGroup,
    SshProbeClient,
    connect,
    list_runs,
)
from tdbg.connect.sshurl import SshTarget
from tdbg.connect.targets import resolve_nodes
from tdbg.connect.waiting import WAKE_SECONDS
from tdbg.tui.sources.base import Notify, SocketSource, Source

BACKOFF_START = 0.5  # seconds before the first retry; doubles on each failure
BACKOFF_CAP = 10.0


@dataclass(frozen=True)
class RemoteRunEntry(RunEntry):
    """A run listed on a remote node; the picker shows the node first."""

    node: SshTarget

    @property
    def target(self) -> SshTarget:
        """The URL that reaches exactly this run."""
        return self.node.with_path(str(self.socket))

    def describe(self) -> str:
        return f"{self.node.node}  {super().describe()}"


def entries_of(listing: RemoteListing) -> list[RemoteRunEntry]:
    node = listing.target.with_path(None)
    out: list[RemoteRunEntry] = []
    for run in listing.runs:
        meta = dict(run)
        meta.setdefault("host", listing.host)
        out.append(RemoteRunEntry(Path(str(run.get("socket", ""))), meta, node))
    return out


def list_listings(
    targets: Sequence[SshTarget], opts: RemoteOptions, group: SshGroup | None = None
) -> tuple[list[RemoteListing], dict[str, str]]:
    """Every node's ``tdbg bridge --list`` (nodes asked in parallel), and why each node that
    failed did, by node.

    ``group.stop()`` (from another thread) ends the listing early. Interrupted here (Ctrl-C),
    it stops every ssh it started before letting the interrupt go: ssh runs in its own
    session, so the terminal's SIGINT never reaches it, and waiting for the pool's threads
    would wait for every ssh to answer or time out.
    """
    listings: list[RemoteListing] = []
    errors: dict[str, str] = {}
    ours = SshGroup() if group is None else group

    def one(target: SshTarget) -> RemoteListing | str:
        try:
            return list_runs(target, opts, group=ours)
        except ConnectError as exc:
            return str(exc)

    pool = ThreadPoolExecutor(max_workers=min(8, max(1, len(targets))))
    try:
        futures = [pool.submit(one, target) for target in targets]
        # Waited for in short slices: the kernel may hand the terminal's SIGINT to any thread,
        # and Python then only flags it for the main thread, which a wait without a timeout
        # never wakes to see (seen: Ctrl-C ignored until ssh gave up, 1 try in 13 under load).
        while wait(futures, timeout=WAKE_SECONDS).not_done:
            pass
        for target, future in zip(targets, futures, strict=True):
            result = future.result()
            if isinstance(result, str):
                errors[target.node] = result
            else:
                listings.append(result)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        ours.stop(wait=TERM_GRACE + 1.0)
        raise
    pool.shutdown(wait=False)
    return listings, errors


def list_nodes(
    targets: Sequence[SshTarget], opts: RemoteOptions, group: SshGroup | None = None
) -> tuple[list[RemoteRunEntry], list[str]]:
    """Every run on every node, and one line per node that failed (see ``list_listings``)."""
    listings, errors = list_listings(targets, opts, group)
    return [e for listing in listings for e in entries_of(listing)], list(errors.values())


class RemoteSource(SocketSource):
    """Runs on one or more ssh nodes. Give ``client`` (already attached) or ``entries`` (already
    listed, for the picker); with neither, ``open()`` lists the nodes itself."""

    watches_for_restart = True
    read_only_reason = None

    def __init__(
        self,
        targets: Sequence[SshTarget],
        opts: RemoteOptions,
        client: SshProbeClient | None = None,
        entries: Sequence[RemoteRunEntry] | None = None,
        warnings: Sequence[str] = (),
    ) -> None:
        Source.__init__(self)
        self.targets = list(targets)
        self.opts = opts
        self.directory = None
        self.client = None
        self.remote: SshTarget | None = None  # the attached run's node and socket path
        self.path = ""
        self.label = ", ".join(t.url() for t in self.targets)
        self.backoff_start = BACKOFF_START
        self.backoff_cap = BACKOFF_CAP
        self.reconnects = 0  # successful reattachments to the same run after a drop
        self._entries = list(entries) if entries is not None else None
        self._warnings = list(warnings)
        self._ssh = SshGroup()  # the listings and connections under way, for stop()
        if client is not None:
            self._attach(client)

    # --- attaching --------------------------------------------------------------------------

    def _attach(self, client: ProbeClient) -> None:
        super()._attach(client)
        if isinstance(client, SshProbeClient):
            socket_path = client.run.get("socket") or client.target.path
            self.remote = client.target.with_path(str(socket_path) if socket_path else None)
            self.path = self.label = self.remote.url()
            self.run.setdefault("node", client.target.node)

    def _connect(self, target: SshTarget) -> None:
        self._attach(connect(target, self.opts, group=self._ssh))

    def stop(self) -> None:
        """Also end the ssh processes still listing or connecting, so that the worker blocked
        on them returns now (the attached run's ssh is stopped by closing its client)."""
        super().stop()
        self._ssh.stop()

    def open(self, notify: Notify) -> None:
        for warning in self._warnings:
            notify(self.WarningRaised(warning))
        if self.client is not None:
            return
        delay = self.backoff_start
        announced = False
        while not self.stopped:
            if self._entries is not None:
                entries, self._entries = self._entries, None
            else:
                entries, errors = list_nodes(self.targets, self.opts, self._ssh)
                for error in errors:
                    notify(self.WarningRaised(error))
            if len(entries) == 1:
                self._connect(entries[0].target)  # its error ends the app's worker, shown
                return
            if len(entries) > 1:
                if self._pick(entries, notify):
                    return
                continue
            if not announced:
                notify(self.WaitStarted(self.label))
                announced = True
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff_cap)
        raise ConnectError("stopped while waiting for a run")

    def _pick(self, entries: list[RemoteRunEntry], notify: Notify) -> bool:
        """Show the picker; True once attached to the chosen run."""
        notify(self.RunsOffered(entries))
        entry = self._await_choice()
        if entry is None:
            return False
        assert isinstance(entry, RemoteRunEntry)
        try:
            self._connect(entry.target)
            return True
        except ConnectError as exc:
            notify(self.WarningRaised(str(exc)))
            return False

    # --- reading and reconnecting -----------------------------------------------------------

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        client = self.client
        yield from super().batches()
        if self.end_reason == "connection closed":
            said = ""
            if isinstance(client, SshProbeClient) and client.ssh.lines:
                said = f": {client.ssh.lines[-1]}"
            self.end_reason = f"connection lost{said}"

    def reattach(self, notify: Notify) -> bool:
        """Reconnect after a drop (same run), or watch the node for a restarted run."""
        if self.remote is None:
            return False
        name = self.run.get("name")
        old = (self.run.get("pid"), self.run.get("start_time"))
        lost = self.end_reason != "shutdown"  # no bye: ssh or the network went, not the run
        delay = self.backoff_start
        warned = False
        while not self.stopped:
            if lost:
                notify(self.ReconnectStarted(self.remote.url()))
                try:
                    self._connect(self.remote)
                    if (self.run.get("pid"), self.run.get("start_time")) == old:
                        self.reconnects += 1
                    return True
                except RemoteError as exc:
                    if exc.no_run:
                        lost = False  # the run ended while we were away: watch for a restart
                    elif not warned:
                        notify(self.WarningRaised(f"reconnecting: {exc}"))
                        warned = True
                except ConnectError:
                    pass
            else:
                entry = self._restarted(name, old)
                if entry is not None:
                    notify(self.ReconnectStarted(entry.describe()))
                    with contextlib.suppress(ConnectError):
                        self._connect(entry.target)
                        return True
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff_cap)
        return False

    def _restarted(self, name: Any, old: tuple[Any, Any]) -> RemoteRunEntry | None:
        """A run of the same name on the same node with a new pid or start time, in the
        directory of the old run's socket (where the restarted script serves too)."""
        assert self.remote is not None
        old_dir = str(PurePosixPath(self.remote.path).parent) if self.remote.path else None
        node = self.remote.with_path(old_dir)
        try:
            listing = list_runs(node, self.opts, group=self._ssh)
        except ConnectError:
            return None
        for entry in entries_of(listing):
            new = (entry.meta.get("pid"), entry.meta.get("start_time"))
            if entry.name == name and new != old:
                return entry
        return None


def remote_source(
    texts: Sequence[str], ssh_options: Sequence[str] = (), remote_tdbg: str = "tdbg"
) -> RemoteSource:
    """What ``tdbg-tui ssh://... [ssh://...]`` attaches to, listed before the app starts so
    that an unreachable host, a missing remote tdbg or no run at all is one line, exit 2."""
    targets = resolve_nodes(
        texts,
        "several targets must all be ssh:// URLs (one per node); a local run is attached alone",
    )
    opts = RemoteOptions(options=tuple(ssh_options), remote_tdbg=remote_tdbg)
    entries, errors = list_nodes(targets, opts)
    return source_for(targets, opts, entries, errors)


def source_for(
    targets: Sequence[SshTarget],
    opts: RemoteOptions,
    entries: Sequence[RemoteRunEntry],
    errors: Sequence[str],
) -> RemoteSource:
    """The single-run source for runs already listed on ``targets`` (``errors``: the nodes
    that failed): the only run attached, or the picker; RemoteError when there is no run."""
    if not entries:
        if errors:
            raise RemoteError("; ".join(errors))
        nodes = ", ".join(t.url() for t in targets)
        raise RemoteError(f"no tdbg run on {nodes}")
    if len(entries) == 1:
        client = connect(entries[0].target, opts)
        return RemoteSource(targets, opts, client=client, warnings=errors)
    return RemoteSource(targets, opts, entries=entries, warnings=errors)
