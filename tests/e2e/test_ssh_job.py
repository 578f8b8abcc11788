"""One job across nodes over ssh: two "nodes" (one real sshd on 127.0.0.1 reached as 127.0.0.1
and as localhost, each node its own runtime directory) running the two node launchers of a real
`torchrun --nnodes=2` job with gloo; the job screen under its Pilot shows every rank with its
node, drills into a rank over the node's one connection, and warns about a node that is down."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sshd as sshd_helper
from jobs import pretend_rank
from processes import torchrun_job
from textual.widgets import Static
from waiting import wait_for, wait_until

from tdbg.connect.runtime import discover
from tdbg.connect.target_errors import TargetError
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.screens.job import JobScreen, RankScreen
from tdbg.tui.sources.remote_job import RemoteJobSource, remote_job_source
from tdbg.tui.widgets.rank_table import RankTable

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def remote_tdbg(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The remote `tdbg` of the nodes: this checkout's (ssh sessions get neither the venv on
    their PATH nor this shell's PYTHONPATH)."""
    script = tmp_path_factory.mktemp("remote") / "tdbg"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m tdbg.cli "$@"\n')
    script.chmod(0o755)
    return str(script)


@contextlib.contextmanager
def node_dir() -> Iterator[Path]:
    """A second node's runtime directory (short, 0700, as the probe wants it)."""
    path = Path(tempfile.mkdtemp(prefix="tdbg-n-", dir="/tmp"))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def node_launcher(
    node_rank: int, port: int, runtime: Path, per_node: int = 2
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """`tdbg run -- torchrun --nnodes=2 --node_rank=N ...`: one node's half of the job, its
    ranks serving in ``runtime``; rank 0 is a slow data loader, which paces every rank."""
    return torchrun_job(
        per_node,
        "--grad-every",
        "1",
        torchrun=(
            "--nnodes=2",
            f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
        ),
        TDBG_RUNTIME_DIR=str(runtime),
        DDP_STEPS="100000",
        DDP_SLOW_RANK="0",
    )


@contextlib.contextmanager
def pretend_ranks(*ranks: tuple[Path, str, int]) -> Iterator[None]:
    """Light ranks of 2-rank jobs (tests/job_rank.py), each (runtime, job, rank), serving."""
    with contextlib.ExitStack() as stack:
        for runtime, job, rank in ranks:
            stack.enter_context(pretend_rank(runtime, job, rank, 2))
        for runtime, job, rank in ranks:

            def serving(r: Path = runtime, j: str = job, k: int = rank) -> bool:
                return any(e.meta.get("job") == j and e.meta.get("rank") == k for e in discover(r))

            wait_until(
                serving,
                120,
                f"rank {rank} of {job} serving",
            )
        yield


def _processes(job: str) -> dict[str, int]:
    """How many ssh clients and remote `tdbg bridge --job JOB` processes run (one each a node)."""
    found = {"ssh": 0, "bridge": 0}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"bridge" not in argv or b"--job" not in argv or job.encode() not in argv:
                    continue
                if argv[0].endswith(b"ssh"):
                    found["ssh"] += 1
                elif b"tdbg.cli" in argv:
                    found["bridge"] += 1
    return found


def _rows(table: RankTable) -> dict[str, str]:
    """rank -> node, as the table shows them."""
    out = {}
    for i in range(table.row_count):
        cells = [str(c) for c in table.get_row_at(i)]
        out[cells[0]] = cells[1]
    return out


async def test_a_job_across_two_nodes(
    sshd: sshd_helper.Sshd, runtime_dir: Path, remote_tdbg: str
) -> None:
    port = sshd_helper.free_port()
    with node_dir() as other, node_launcher(0, port, runtime_dir), node_launcher(1, port, other):
        wait_until(
            lambda: len(discover(runtime_dir)) == 2 and len(discover(other)) == 2,
            120,
            "both nodes' ranks serving",
        )
        node_a = f"ssh://{sshd.user}@127.0.0.1:{sshd.port}{runtime_dir}"
        node_b = f"ssh://{sshd.user}@localhost:{sshd.port}{other}"
        down = f"ssh://{sshd.user}@127.0.0.1:{sshd_helper.free_port()}"  # a node that is down
        source = remote_job_source(
            [node_a, node_b, down], None, None, sshd.client_options()[1::2], remote_tdbg
        )
        assert isinstance(source, RemoteJobSource)  # every run a rank of one job: the job
        app = JobApp(source)
        async with app.run_test(size=(180, 45)) as pilot:
            await wait_for(pilot, lambda: len(app.job.ranks) == 4, "all 4 ranks attached", 120)
            table = app.screen.query_one(RankTable)
            await wait_for(pilot, lambda: table.row_count == 4, "4 rows")
            name_a, name_b = (
                f"{sshd.user}@127.0.0.1:{sshd.port}",
                f"{sshd.user}@localhost:{sshd.port}",
            )
            assert _rows(table) == {"0": name_a, "1": name_a, "2": name_b, "3": name_b}
            header = (f"job 127.0.0.1:{port}", "of 4 ranks")
            await wait_for(pilot, lambda: all(h in screen_text(app) for h in header), "the job")
            # The node that is down is a warning on the job screen, the others shown meanwhile.
            nodes = app.screen.query_one("#job-nodes", Static)
            await wait_for(
                pilot,
                lambda: "connection refused by" in str(nodes.content) and nodes.display,
                "the down node's warning on the job screen",
            )
            assert f"127.0.0.1:{down.rsplit(':', 1)[1]}" in str(nodes.content)
            # One ssh per node carries that node's ranks: two links, two bridges, four ranks.
            assert sorted(source.links) == sorted([name_a, name_b])
            assert _processes(app.job.job) == {"ssh": 2, "bridge": 2}
            assert {source.rank_node[r] for r in (0, 1)} == {name_a}
            assert {source.rank_node[r] for r in (2, 3)} == {name_b}
            # Enter on a rank of the second node opens its full screen, over that node's link.
            row = next(i for i in range(table.row_count) if str(table.get_row_at(i)[0]) == "3")
            table.move_cursor(row=row)
            table.focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, RankScreen), "rank 3's screen")
            assert isinstance(app.screen, RankScreen) and app.screen.rank == 3
            await wait_for(
                pilot, lambda: "Gradient norms per layer" in screen_text(app), "its panels"
            )
            # A deep dive goes to that rank's probe through the same connection, and back.
            await pilot.press("s")
            state = app.job.ranks[3]
            await wait_for(
                pilot, lambda: state.deep.activations is not None, "rank 3's activation stats", 60
            )
            assert app.job.ranks[2].deep.activations is None  # only the rank asked
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, JobScreen), "back to the job")
        source.close()
        gone = {"ssh": 0, "bridge": 0}
        wait_until(lambda: _processes(app.job.job) == gone, what="the nodes' ssh and bridges gone")


async def test_two_jobs_are_never_mixed_and_versions_are_compared(
    sshd: sshd_helper.Sshd, runtime_dir: Path, tmp_path: Path, remote_tdbg: str
) -> None:
    """Node A has ranks of jobs `alpha` and `beta`, node B alpha's other rank and an older tdbg:
    without --job the TUI refuses on one line; with it only alpha's ranks show, and the
    screen says the versions differ."""
    with (
        node_dir() as other,
        pretend_ranks((runtime_dir, "alpha", 0), (runtime_dir, "beta", 0), (other, "alpha", 1)),
    ):
        # Node B's tdbg says it is 0.0.1 (a wrapper standing in for an older install there).
        older = tmp_path / "tdbg-older"
        older.write_text(
            "#!/bin/sh\n"
            f'case "$*" in *{other}*) PYTHONPATH={REPO} exec {sys.executable} -c "import sys, '
            "tdbg; "
            "tdbg.__version__ = '0.0.1'; from tdbg.cli.main import main; "
            f'sys.exit(main(sys.argv[1:]))" "$@";; esac\n'
            f'exec {remote_tdbg} "$@"\n'
        )
        older.chmod(0o755)
        hosts = tmp_path / "hosts"  # the two nodes as a hostfile: user@host:port/runtime-dir
        hosts.write_text(
            f"# node A, then node B\n{sshd.user}@127.0.0.1:{sshd.port}{runtime_dir}\n"
            f"{sshd.user}@localhost:{sshd.port}{other}  slots=2\n"
        )
        options = sshd.client_options()[1::2]
        listed = subprocess.run(
            [sys.executable, "-m", "tdbg.cli", "ls", "--json", "--hostfile", str(hosts)]
            + [*sshd.client_options(), "--remote-tdbg", str(older)],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert listed.returncode == 0, listed.stderr
        runs = [json.loads(line) for line in listed.stdout.splitlines()]
        assert sorted((r["node"].split("@")[1].split(":")[0], r["job"]) for r in runs) == [
            ("127.0.0.1", "alpha"),
            ("127.0.0.1", "beta"),
            ("localhost", "alpha"),
        ]
        with pytest.raises(TargetError) as err:
            remote_job_source([], str(hosts), None, options, str(older))
        assert "ranks of 2 different jobs here" in str(err.value)
        assert "pick one with --job JOB" in str(err.value) and "\n" not in str(err.value)
        source = remote_job_source([], str(hosts), "alpha", options, str(older))
        assert isinstance(source, RemoteJobSource)
        app = JobApp(source)
        async with app.run_test(size=(180, 45)) as pilot:
            await wait_for(pilot, lambda: len(app.job.ranks) == 2, "alpha's two ranks", 120)
            table = app.screen.query_one(RankTable)
            await wait_for(pilot, lambda: table.row_count == 2, "2 rows")
            assert set(_rows(table)) == {"0", "1"}
            assert {s.run.get("job") for s in app.job.ranks.values()} == {"alpha"}
            nodes = app.screen.query_one("#job-nodes", Static)
            await wait_for(
                pilot, lambda: "tdbg versions differ" in str(nodes.content), "the version line"
            )
            text = str(nodes.content)
            assert text.count("\n") == 0  # one line, and both nodes reached: nothing else
            assert "0.0.1 on " in text and "install one version everywhere" in text
        source.close()
