"""A 64-rank job on 8 simulated nodes read the way a large job is read: one real
``tdbg bridge --job --summaries`` per node behind a stand-in for ssh, synthetic ranks speaking
the probe's wire (benchmarks/fake_ranks.py). A slow rank, a diverged rank, a hung rank and a
dead rank are each named from the nodes' summaries as the 2-rank tests name them; opening a
rank brings its whole stream, and closing it gives the stream back. A straggler that comes and
goes is named as such from the windows the bridges send."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import kill_tree
from waiting import wait_until

from tdbg.connect.ssh import RemoteOptions
from tdbg.connect.sshurl import parse_ssh_url
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.job_scale import worst_rows
from tdbg.tui.sources.remote_job import RemoteJobSource

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "benchmarks" / "fake_ranks.py"
LOCAL_SSH = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift 2\nexec sh -c "$*"\n'
NODES, PER_NODE = 8, 8
SLOW, DIVERGED, HUNG, DEAD = 5, 13, 42, 63
RATE = 10.0
GIB = 2**30
HANG_AT = 200 + int(RATE * 6)  # the fake ranks start at step 200: a hang ~6 s in


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
def fake_nodes(
    root: Path, faults: list[str] | None = None
) -> Iterator[tuple[list[Path], subprocess.Popen[bytes]]]:
    """8 node directories of 8 ranks each; rank DEAD served by a process of its own (yielded,
    for the test to kill). ``faults``: fake_ranks.py's options (default: the four faults)."""
    procs: list[subprocess.Popen[bytes]] = []
    dirs = []
    world = NODES * PER_NODE
    if faults is None:
        faults = ["--slow", str(SLOW), "--diverge", str(DIVERGED), "--hang", str(HUNG),
                  "--hang-at", str(HANG_AT)]  # fmt: skip
    faults = [*faults, "--rate", str(RATE), "--job", "big"]

    def start(ranks: list[int], where: Path, host: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, str(FAKE), "--ranks", *map(str, ranks), "--world", str(world),
                "--runtime", str(where), "--host", host, *faults]  # fmt: skip
        proc = subprocess.Popen(
            argv, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True
        )
        procs.append(proc)
        return proc

    try:
        for node in range(NODES):
            where = root / f"node{node}"
            where.mkdir(mode=0o700)
            dirs.append(where)
            ranks = [r for r in range(node * PER_NODE, (node + 1) * PER_NODE) if r != DEAD]
            start(ranks, where, f"node{node}")
        dead = start([DEAD], dirs[DEAD // PER_NODE], f"node{DEAD // PER_NODE}")
        wait_until(
            lambda: sum(len(list(d.glob("*.json"))) for d in dirs) == world,
            what="the fake ranks serving",
        )
        yield dirs, dead
    finally:
        for proc in procs:
            kill_tree(proc)


def test_four_faults_in_64_ranks_on_8_nodes_are_named(
    tmp_path: Path, local_ssh: RemoteOptions
) -> None:
    with fake_nodes(tmp_path) as (dirs, dead):
        targets = [parse_ssh_url(f"ssh://node{k}{d}") for k, d in enumerate(dirs)]
        source = RemoteJobSource("big", targets, local_ssh, summaries=True)
        nodes, alerts = NodesJob("big"), JobAlerts()
        killed = False

        def judged() -> bool:
            nonlocal killed
            for node, summary in source.take_summaries().items():
                nodes.update(node, summary)
            alerts.update(nodes)
            if not killed and DEAD in nodes.figures:
                os.kill(dead.pid, 9)  # not reaped yet: the bridge reads its exit status
                killed = True
            active = {(a.kind, tuple(a.ranks)) for a in alerts.active.values()}
            gone = nodes.gone()
            return (
                ("straggler", (SLOW,)) in active
                and ("rank_divergence", (DIVERGED,)) in active
                and ("hang", (HUNG,)) in active
                and DEAD in gone
            )

        try:
            threading_open(source)
            wait_until(
                judged,
                timeout=90,
                what="the four faults named",
                detail=lambda: (list(alerts.active), nodes.gone(), len(nodes.figures)),
                interval=0.2,
            )
            by_kind = {a.kind: a for a in alerts.active.values()}
            assert by_kind["straggler"].finding.phase == "data_time"
            assert "mostly input wait (+20.0 ms)" in by_kind["straggler"].message
            assert by_kind["rank_divergence"].finding.layers == [nodes_layer_last(nodes)]
            hang = by_kind["hang"].finding
            assert hang.collective is not None and hang.collective["seq"] == HANG_AT
            assert "rank 42 never entered collective" in hang.message
            assert "next_batch" in hang.stacks[HUNG]
            assert nodes.gone()[DEAD] == "dead: killed by SIGKILL"
            assert len(nodes.figures) == NODES * PER_NODE and len(nodes.nodes) == NODES
            # Only the summaries came: no rank's whole stream was read.
            assert not source.runs
            # Opening a rank brings its whole stream over its node's link; closing gives it back.
            assert source.subscribe(SLOW, "node0")
            wait_until(lambda: SLOW in source.runs, what="rank 5's whole stream")
            assert source.runs[SLOW]["rank"] == SLOW
            source.unsubscribe(SLOW)
            assert SLOW not in source.runs
        finally:
            source.close()
            with contextlib.suppress(ProcessLookupError):
                dead.wait(5)


def test_a_straggler_that_comes_and_goes_is_named_intermittent_from_the_summaries(
    tmp_path: Path, local_ssh: RemoteOptions
) -> None:
    """Rank SLOW waits 20 ms more for 25 steps of every 60: the ranks' 200 steps of history and
    then their live steps, window by window from 8 bridges, name it intermittent, in input wait."""
    faults = ["--slow", str(SLOW), "--slow-every", "60", "--slow-for", "25"]
    with fake_nodes(tmp_path, faults) as (dirs, _):
        targets = [parse_ssh_url(f"ssh://node{k}{d}") for k, d in enumerate(dirs)]
        source = RemoteJobSource("big", targets, local_ssh, summaries=True)
        nodes, alerts = NodesJob("big"), JobAlerts()

        def named() -> bool:
            for node, summary in source.take_summaries().items():
                nodes.update(node, summary)
            alerts.update(nodes)
            every = len(nodes.figures) == NODES * PER_NODE
            return every and [(r.rank, r.kind) for r in alerts.history.named()] == [
                (SLOW, "intermittent")
            ]

        try:
            threading_open(source)
            wait_until(
                named,
                timeout=60,
                what="rank 5 named intermittent",
                detail=lambda: (alerts.history.line(), len(nodes.figures)),
                interval=0.2,
            )
            [record] = alerts.history.named()
            assert record.spells >= 2 and record.phase_words() == "input wait"
            assert alerts.history.line().startswith(f"rank {SLOW} (intermittent): the slowest in ")
            assert not source.runs  # from the summaries alone: no rank read whole
        finally:
            source.close()


def threading_open(source: RemoteJobSource, nodes: int = NODES) -> None:
    """Open the source and drain its (subscribed ranks') batches on a thread, as the app does."""
    import threading

    def drain() -> None:
        for _ in source.batches():
            pass

    def start() -> None:
        source.open(lambda message: None)
        drain()

    threading.Thread(target=start, daemon=True).start()
    wait_until(lambda: len(source.links) == nodes, what="every node's bridge")


def nodes_layer_last(nodes: NodesJob) -> str:
    names = next(iter(nodes.names.values()))
    return names[-1]


def test_a_local_job_of_24_ranks_is_read_through_a_bridge_of_its_own(tmp_path: Path) -> None:
    """Past 16 ranks a local job goes through the same aggregation: `tdbg-tui --job` starts
    `tdbg bridge --job --summaries` here (before its own imports), over its stdin/stdout, and
    reads no rank whole; each rank's memory and GPU figures come in its node's summaries."""
    from tdbg.cli.launch import job_source_for
    from tdbg.connect.node_link import spawn_local_bridge

    argv = [sys.executable, str(FAKE), "--ranks", *map(str, range(24)), "--world", "24",
            "--runtime", str(tmp_path), "--job", "local", "--slow", "3", "--gpu",
            "--heavy", "7"]  # fmt: skip
    server = subprocess.Popen(
        argv, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True
    )
    try:
        wait_until(lambda: len(list(tmp_path.glob("*.json"))) == 24, what="24 ranks serving")
        # Started before the TUI's imports, as `tdbg-tui --job` starts it; read by the source.
        spawned = spawn_local_bridge("local", tmp_path)
        assert spawned is not None and spawned.ssh.proc.poll() is None
        source = job_source_for("local", tmp_path, spawned)
        assert isinstance(source, RemoteJobSource) and source.aggregated
        nodes, alerts = NodesJob("local"), JobAlerts()
        try:
            threading_open(source, nodes=1)

            def named() -> bool:
                for node, summary in source.take_summaries().items():
                    nodes.update(node, summary)
                alerts.update(nodes)
                active = [(a.kind, a.ranks) for a in alerts.active.values()]
                return len(nodes.figures) == 24 and ("straggler", [3]) in active

            wait_until(named, timeout=60, what="24 ranks, rank 3 a straggler", interval=0.2)
            assert not source.runs  # no rank read whole
            [link] = source.links.values()
            assert link.ssh is spawned.ssh  # the bridge started early, not a second one
            # Each rank's memory and GPU, from its own system report through the bridge.
            wait_until(
                lambda: named() and all(f.peak is not None for f in nodes.figures.values()),
                what="every rank's memory figures",
            )
            heavy, other = nodes.figures[7], nodes.figures[0]
            assert (heavy.allocated, heavy.reserved, heavy.peak) == (24 * GIB, 28 * GIB, 26 * GIB)
            assert (other.allocated, other.reserved, other.peak) == (12 * GIB, 14 * GIB, 13 * GIB)
            assert (heavy.gpu_util, heavy.gpu_mem, other.gpu_util) == (40.0, 30 * GIB, 87.0)
            rows = {row.rank: row for row in worst_rows(nodes, alerts, shown=24)}
            assert rows[7].memory == 26 * GIB and rows[7].gpu_util == 40.0 and rows[7].on_gpu
        finally:
            source.close()
    finally:
        kill_tree(server)
