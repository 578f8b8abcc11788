"""The node stream without sshd: `tdbg bridge --job` started through a stand-in for ssh that runs
the remote command here, two in-process probes as ranks of one job and a single run beside them;
both ranks come over the one link, commands go back through it, and closing it ends the bridge.
Malformed node messages read as None, never raise."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import Loop
from waiting import wait_until

from tdbg.connect.client import ProbeClient
from tdbg.connect.node_link import NodeLink
from tdbg.connect.ssh import RemoteError, RemoteOptions
from tdbg.connect.sshurl import parse_ssh_url
from tdbg.protocol.messages import read_node_message

if TYPE_CHECKING:
    from textual.message import Message

    from tdbg.connect.sshurl import SshTarget
    from tdbg.tui.sources.remote_job import RemoteJobSource

REPO = Path(__file__).resolve().parents[2]

# Stands in for `ssh [options] -- host WORDS`: runs WORDS here with a shell, as sshd would there.
LOCAL_SSH = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec sh -c "$*"\n'


@pytest.fixture
def local_ssh(tmp_path: Path) -> RemoteOptions:
    ssh = tmp_path / "ssh"
    ssh.write_text(LOCAL_SSH)
    ssh.chmod(0o755)
    tdbg = tmp_path / "tdbg"
    tdbg.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m tdbg.cli "$@"\n')
    tdbg.chmod(0o755)
    return RemoteOptions(ssh=str(ssh), remote_tdbg=str(tdbg))


@contextlib.contextmanager
def ranks(
    monkeypatch: pytest.MonkeyPatch, job: str, count: int, runtime: Path | None = None
) -> Iterator[list[object]]:
    """Ranks 0 to ``count - 1`` of a job of at least 2 ranks, probes in this process as
    torchrun's variables say (serving in ``runtime``, default: the test's runtime directory)."""
    import tdbg

    probes = []
    for rank in range(count):
        if runtime is not None:
            monkeypatch.setenv("TDBG_RUNTIME_DIR", str(runtime))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        monkeypatch.setenv("WORLD_SIZE", str(max(count, 2)))
        monkeypatch.setenv("RANK", str(rank))
        loop = Loop(seed=rank)
        probe = tdbg.watch(loop.model, loop.opt, name=f"rank{rank}")
        loop.run(3, probe)
        probes.append(probe)
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name)
    try:
        yield probes
    finally:
        for probe in probes:
            probe.close()  # type: ignore[attr-defined]


@dataclass
class WatchedSource:
    """A job source that is open, what it has said (notices) and the (rank, node) of each
    rank's hello, in the order they came."""

    source: RemoteJobSource
    notices: list[Message] = field(default_factory=list)
    hellos: list[tuple[int, str]] = field(default_factory=list)

    def warnings(self) -> list[str]:
        return [n.text for n in self.notices if isinstance(n, self.source.WarningRaised)]

    def node_lines_said(self) -> list[list[str]]:
        return [n.lines for n in self.notices if isinstance(n, self.source.NodesChecked)]


@contextlib.contextmanager
def watched_source(
    nodes: list[SshTarget], opts: RemoteOptions, backoff: float | None = None
) -> Iterator[WatchedSource]:
    """``RemoteJobSource`` for job jobx over ``nodes``, opened, its batches read on a thread
    (reconnecting after ``backoff`` seconds when given); closed afterwards."""
    from tdbg.tui.sources.remote_job import RemoteJobSource

    watched = WatchedSource(RemoteJobSource("jobx", nodes, opts))
    if backoff is not None:
        watched.source.backoff_start = watched.source.backoff_cap = backoff

    def read() -> None:
        for batch in watched.source.batches():
            for rank, messages in batch.items():
                watched.hellos.extend((rank, m["node"]) for m in messages if m["type"] == "hello")

    try:
        watched.source.open(watched.notices.append)
        threading.Thread(target=read, daemon=True).start()
        yield watched
    finally:
        watched.source.close()


def _bridges(directory: Path) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"--job" in argv and str(directory).encode() in argv:
                    pids.append(int(pid))
    return pids


def test_one_link_carries_every_rank_of_the_job(
    runtime_dir: Path, local_ssh: RemoteOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tdbg

    with ranks(monkeypatch, "jobx", 2):
        single = tdbg.watch(Loop().model, name="alone")  # not a rank: never served
        try:
            link = NodeLink.open(parse_ssh_url(f"ssh://node1{runtime_dir}"), local_ssh, "jobx")
            assert link.hello is not None and link.hello["job"] == "jobx"
            assert link.version == tdbg.__version__
            stop = threading.Event()
            clients: dict[int, ProbeClient] = {}
            for channel in link.channels(stop):
                client = ProbeClient.handshake(channel.sock, "test", 30)
                clients[int(client.run["rank"])] = client
                assert channel.run["job"] == "jobx"
                if len(clients) == 2:
                    break
            assert sorted(clients) == [0, 1]
            for rank, client in clients.items():
                # A command goes up the rank's channel and its answer comes back down it.
                mid = client.send("ping")
                pong = next(m for m in client.messages(timeout=30) if m.get("type") == "pong")
                assert pong["id"] == mid
                assert client.run["name"] == f"rank{rank}"
            assert len(_bridges(runtime_dir)) == 1
            link.close()
            for client in clients.values():
                list(client.messages(timeout=30))  # EOF: the link's end reaches every rank
                assert client.peer_closed
            wait_until(lambda: not _bridges(runtime_dir), what="the bridge gone")
        finally:
            single.close()


def test_a_bridge_that_cannot_serve_a_job_is_one_line(
    tmp_path: Path, local_ssh: RemoteOptions
) -> None:
    old = tmp_path / "old-tdbg"
    old.write_text('#!/bin/sh\necho "tdbg: error: unrecognized arguments: --job x" >&2\nexit 2\n')
    old.chmod(0o755)
    opts = RemoteOptions(ssh=local_ssh.ssh, remote_tdbg=str(old))
    with pytest.raises(RemoteError, match="too old to serve a job's ranks") as err:
        NodeLink.open(parse_ssh_url("ssh://node1"), opts, "x", timeout=30)
    assert "\n" not in str(err.value)
    missing = parse_ssh_url(f"ssh://node1{tmp_path}/nope")
    with pytest.raises(RemoteError, match="no such directory") as err:
        NodeLink.open(missing, local_ssh, "x", timeout=30)
    assert err.value.no_run


@pytest.mark.parametrize(
    "message",
    [
        None,
        [],
        {"type": "open", "ch": "1", "run": {}},
        {"type": "open", "ch": 1, "run": []},
        {"type": "data", "ch": 1, "data": "text, not bytes"},
        {"type": "data"},
        {"type": "mystery", "ch": 1},
    ],
)
def test_malformed_node_messages_read_as_none(message: object) -> None:
    assert read_node_message(message) is None


def test_node_messages_read_back() -> None:
    assert read_node_message({"type": "close", "ch": 3}) == {
        "type": "close",
        "ch": 3,
        "reason": "closed",
    }
    hello = read_node_message({"type": "node", "tdbg": 5, "protocol": "x"})
    assert hello == {
        "type": "node",
        "tdbg": "?",
        "protocol": [0, 0],
        "host": "",
        "runtime_dir": "",
        "job": "",
    }


def test_a_job_source_reconnects_a_dropped_node_and_warns_about_a_missing_one(
    runtime_dir: Path, local_ssh: RemoteOptions, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    node = parse_ssh_url(f"ssh://node1{runtime_dir}")
    gone = parse_ssh_url(f"ssh://node2{tmp_path}/nope")
    with ranks(monkeypatch, "jobx", 2):
        with watched_source([node, gone], local_ssh, backoff=0.2) as watched:
            source, hellos = watched.source, watched.hellos
            wait_until(lambda: sorted(hellos) == [(0, "node1"), (1, "node1")], 60, "both ranks")
            wait_until(lambda: any("no such directory" in n for n in source.node_lines()), 30)
            assert source.rank_node == {0: "node1", 1: "node1"}
            # The node's connection drops (its bridge dies): the node says reconnecting, then
            # its ranks come back over a new link, each with a new hello (history replayed).
            (pid,) = _bridges(runtime_dir)
            os.kill(pid, 9)
            wait_until(
                lambda: any("reconnecting" in str(lines) for lines in watched.node_lines_said()),
                30,
                "reconnecting said",
            )
            wait_until(lambda: len(hellos) == 4, 60, "both ranks again")
            wait_until(lambda: "node1" in source.links, 30, "the link back")
            assert not any("node1" in line for line in source.node_lines())
        wait_until(lambda: not _bridges(runtime_dir), what="the bridge gone")


def test_a_rank_claimed_by_two_nodes_is_shown_once_with_a_warning(
    runtime_dir: Path, local_ssh: RemoteOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes whose runs share a job id and both say rank 0 (two jobs launched with one id):
    the first node's rank 0 is shown, the second's is refused with a warning, never mixed in."""
    other = Path(tempfile.mkdtemp(prefix="tdbg-n-", dir="/tmp"))  # short: socket paths
    os.chmod(other, 0o700)
    first = parse_ssh_url(f"ssh://node1{runtime_dir}")
    second = parse_ssh_url(f"ssh://node2{other}")
    try:
        with (
            ranks(monkeypatch, "jobx", 1, runtime_dir),
            ranks(monkeypatch, "jobx", 1, other),
            watched_source([first, second], local_ssh) as watched,
        ):
            warned = wait_until(
                lambda: [text for text in watched.warnings() if "both" in text],
                60,
                "the warning",
            )
            (shown,) = watched.hellos
            assert warned == [
                f"rank 0 is on both {shown[1]} and {({'node1', 'node2'} - {shown[1]}).pop()}: "
                f"two jobs with one id? showing {shown[1]}'s"
            ]
            assert watched.source.rank_node == {0: shown[1]}
    finally:
        shutil.rmtree(other, ignore_errors=True)
