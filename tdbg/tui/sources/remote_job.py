"""Every rank of one job across ssh nodes: one ``NodeLink`` (one ssh) per node carries all of
that node's ranks; a node that cannot be reached is retried with backoff and shown as a
warning while the others are read; the nodes' tdbg versions are compared.

It is a ``JobSource`` (the job app drives it the same way): each rank's ``ProbeClient`` talks
over its channel of the node's link, so drilling into a rank and its deep dives use the same
connection.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path

from tdbg import __version__
from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.jobs import SCALE_FROM, job_size, one_job
from tdbg.connect.node_link import LOCAL_TDBG, Channel, NodeLink, Spawned, local_target
from tdbg.connect.nodes import node_targets
from tdbg.connect.ssh import RemoteOptions, SshGroup
from tdbg.connect.sshurl import SshTarget
from tdbg.protocol.messages.node_summary import NodeSummary
from tdbg.tui.sources.job import JobSource, Notify
from tdbg.tui.sources.remote import (
    BACKOFF_CAP,
    BACKOFF_START,
    RemoteRunEntry,
    RemoteSource,
    entries_of,
    list_listings,
    source_for,
)

HANDSHAKE_TIMEOUT = 30.0  # a rank's hello through its node's link


class RemoteJobSource(JobSource):
    """Job ``job``'s ranks on ``targets``. ``versions`` are the nodes' tdbg versions already
    known (from listing them); ``problems`` why each node that could not be listed was not."""

    def __init__(
        self,
        job: str,
        targets: Sequence[SshTarget],
        opts: RemoteOptions,
        problems: dict[str, str] | None = None,
        versions: dict[str, str] | None = None,
        summaries: bool = False,
        local: Sequence[str] | None = None,
        spawned: Spawned | None = None,
    ) -> None:
        """``summaries``: each node's bridge sends summaries of its ranks, and a rank's whole
        stream only once subscribed to. ``local``: the command that runs tdbg here, for this
        machine's ranks read through a bridge of their own (no ssh). ``spawned``: that bridge,
        started already (the first try reads it)."""
        super().__init__(job)
        self.aggregated = summaries
        self.local = None if local is None else list(local)
        self.targets = list(targets)
        self.opts = opts
        self.label = f"job {job} on {len(self.targets)} node{'s' if len(self.targets) > 1 else ''}"
        self.backoff_start = BACKOFF_START
        self.backoff_cap = BACKOFF_CAP
        self.links: dict[str, NodeLink] = {}  # node -> its live link
        self.problems: dict[str, str] = dict(problems or {})  # node -> why it is not read
        self.versions: dict[str, str] = dict(versions or {})  # node -> its tdbg version
        self.rank_node: dict[int, str] = {}  # rank -> the node it was reached on
        self._ssh = SshGroup()
        self._notify: Notify = lambda message: None
        self._said: list[str] | None = None  # the node lines last shown
        self._threads: list[threading.Thread] = []
        self._spawned = spawned

    # --- the worker's side --------------------------------------------------------------------
    def open(self, notify: Notify) -> None:
        """Start one thread per node; block until a rank is attached (or stopped)."""
        self._notify = notify
        self._say_nodes()
        for target in self.targets:
            thread = threading.Thread(
                target=self._serve_node, args=(target,), name=f"tdbg-{target.node}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        announced = False
        while not self._stop.is_set():
            if self._clients or (self.aggregated and self.links):  # a node summarises
                return
            if not announced:
                notify(self.WaitStarted(f"a rank of job {self.job} on {len(self.targets)} nodes"))
                announced = True
            self._stop.wait(0.1)
        raise ConnectError("stopped while waiting for the job's ranks")

    def _take_spawned(self) -> Spawned | None:
        spawned, self._spawned = self._spawned, None
        return spawned

    def _attach_new(self, notify: Notify) -> bool:
        return bool(self._clients)  # the node threads attach ranks as their links bring them

    def node_lines(self) -> list[str]:
        """One line per node that is not read, and one when the nodes' tdbg versions differ."""
        lines = [why for _, why in sorted(self.problems.items())]
        mismatch = version_mismatch(self.versions)
        if mismatch:
            lines.append(mismatch)
        return lines

    def _say_nodes(self) -> None:
        lines = self.node_lines()
        if lines != self._said:
            self._said = lines
            self._notify(self.NodesChecked(lines))

    def _problem(self, node: str, why: str) -> None:
        self.problems[node] = why
        self._say_nodes()

    def _serve_node(self, target: SshTarget) -> None:
        """Keep one link to ``target`` up (backoff between tries) and attach what it brings."""
        node = target.node
        delay = self.backoff_start
        while not self._stop.is_set():
            try:
                link = NodeLink.open(
                    target,
                    self.opts,
                    self.job or "",
                    group=self._ssh,
                    summaries=self.aggregated,
                    local=self.local,
                    spawned=self._take_spawned(),
                )
            except ConnectError as exc:
                self._problem(node, f"{exc}; retrying")
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_cap)
                continue
            delay = self.backoff_start
            self.links[node] = link
            self.versions[node] = link.version
            self.problems.pop(node, None)
            self._say_nodes()
            if self._stop.is_set():
                link.close()
                return
            for channel in link.channels(self._stop):
                self._drain_notices(link)
                threading.Thread(
                    target=self._serve_rank,
                    args=(channel,),
                    name=f"tdbg-{node}-ch{channel.ch}",
                    daemon=True,
                ).start()
            self._drain_notices(link)
            self.links.pop(node, None)
            link.close()
            if self._stop.is_set():
                return
            self._problem(node, f"{node}: {link.reason or 'connection lost'}; reconnecting")
            self._stop.wait(delay)

    def _drain_notices(self, link: NodeLink) -> None:
        while not link.notices.empty():
            self._notify(self.WarningRaised(f"{link.target.node}: {link.notices.get()}"))

    def _serve_rank(self, channel: Channel) -> None:
        """Handshake with the rank's probe over its channel, then read it like a local rank."""
        node = channel.node.node
        label = channel.node.url(str(channel.run.get("socket") or ""))
        try:
            client = ProbeClient.handshake(channel.sock, label, HANDSHAKE_TIMEOUT)
        except ConnectError as exc:
            channel.sock.close()
            self._notify(self.WarningRaised(f"{node}: rank {channel.run.get('rank', '?')}: {exc}"))
            return
        rank = int(client.run.get("rank") or 0)
        other = self.rank_node.get(rank)
        current = self._clients.get(rank)
        if other is not None and other != node and current is not None and not current.peer_closed:
            self._notify(
                self.WarningRaised(
                    f"rank {rank} is on both {other} and {node}: two jobs with one id? "
                    f"showing {other}'s"
                )
            )
            client.close()
            return
        if current is not None:  # the same rank again (a restart): the new one wins
            with contextlib.suppress(OSError):
                current.sock.shutdown(2)
        self.rank_node[rank] = node
        self._register(rank, client, node=node)
        self._read(rank, client)

    # --- summaries and subscriptions (aggregated) ------------------------------------------------
    def take_summaries(self) -> dict[str, NodeSummary]:
        out = {}
        for node, link in list(self.links.items()):
            summary = link.take_summary()
            if summary is not None:
                out[node] = summary
        return out

    def subscribe(self, rank: int, node: str) -> bool:
        link = self.links.get(node)
        if link is None:
            self.send_error = f"{node} is not connected: rank {rank} cannot be opened"
            return False
        try:
            link.subscribe(rank)
        except OSError as exc:
            self.send_error = f"{node}: {exc}"
            return False
        return True

    def close(self) -> None:
        super().close()
        self._ssh.stop()
        spawned = self._take_spawned()  # started for the app, never read: closed with it
        if spawned is not None:
            spawned.close()
        for link in list(self.links.values()):
            link.close()


def version_mismatch(versions: dict[str, str], ours: str = __version__) -> str | None:
    """One line when the nodes' tdbg (or this one) are not all the same version."""
    if not versions or set(versions.values()) == {ours}:
        return None
    by_version: dict[str, list[str]] = {}
    for node, version in sorted(versions.items()):
        by_version.setdefault(version, []).append(node)
    shown = "; ".join(f"{v} on {', '.join(nodes)}" for v, nodes in sorted(by_version.items()))
    return f"tdbg versions differ: {shown} (this tdbg {ours}): install one version everywhere"


def remote_job_source(
    texts: Sequence[str],
    hostfile: str | None = None,
    job: str | None = None,
    ssh_options: Sequence[str] = (),
    remote_tdbg: str = "tdbg",
) -> RemoteJobSource | RemoteSource:
    """What ``tdbg-tui ssh://... [--hostfile F] [--job JOB]`` shows, listed before the app
    starts: the job (``--job JOB``, or every listed run a rank of one job) or, when the runs are
    not one job's ranks, the single-run source (the only run, or the picker). TargetError /
    RemoteError with one line when nothing can be shown: a bad node list, no node answered, no
    run, or ranks of several jobs and no ``--job`` (never mixed)."""
    targets = node_targets(
        texts,
        hostfile,
        "several targets must all be ssh:// URLs (one per node); a local run is attached alone",
    )
    opts = RemoteOptions(options=tuple(ssh_options), remote_tdbg=remote_tdbg)
    listings, errors = list_listings(targets, opts)
    entries = [e for listing in listings for e in entries_of(listing)]
    if job is None and listings:
        found = one_job(entries, lambda e: e.node.node if isinstance(e, RemoteRunEntry) else "")
        if found is not None and (len(targets) > 1 or len(entries) > 1):
            job = found
    if job is None or not listings:
        return source_for(targets, opts, entries, list(errors.values()))
    versions = {listing.target.node: listing.tdbg for listing in listings}
    problems = {node: f"{why}; retrying" for node, why in errors.items()}
    large = job_size(entries, job) > SCALE_FROM
    return RemoteJobSource(job, targets, opts, problems, versions, summaries=large)


def local_job_source(
    job: str, directory: Path | None = None, spawned: Spawned | None = None
) -> RemoteJobSource:
    """This machine's ranks of ``job`` read through a ``tdbg bridge --job --summaries`` of
    their own, over its stdin/stdout as ssh would carry it: a large local job is aggregated
    the same way as a node of a multi-node one. ``spawned``: that bridge, already started
    (``spawn_local_bridge``, before the TUI's imports)."""
    target = local_target(directory)
    source = RemoteJobSource(
        job, [target], RemoteOptions(), summaries=True, local=LOCAL_TDBG, spawned=spawned
    )
    source.label = f"job {job}"
    return source
