"""`--job JOB` on `tdbg dump`, `tdbg status` and `tdbg ls`: a job's local ranks as the targets,
each event and line saying its rank; another job's ranks never mixed in; bad use one line."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
from jobs import pretend_rank
from test_cli import TDBG, events, run_cli
from waiting import wait_until

from tdbg.connect.runtime import discover


@pytest.mark.slow
def test_dump_status_and_ls_take_a_job(runtime_dir: Path) -> None:
    with ExitStack() as stack:
        for job, rank in (("jobA", 0), ("jobA", 1), ("jobB", 0)):
            stack.enter_context(pretend_rank(runtime_dir, job, rank, 2))
        wait_until(lambda: len(discover(runtime_dir)) == 3, 120, "three probes serving")

        dump = run_cli("dump", "--job", "jobA", "--count", "5", runtime=runtime_dir)
        assert dump.returncode == 0, dump.stderr
        evs = events(dump.stdout)
        hellos = [e for e in evs if e["type"] == "hello"]
        assert sorted(h["rank"] for h in hellos) == [0, 1]
        assert {h["run"]["job"] for h in hellos} == {"jobA"}  # jobB's rank never joins
        for rank in (0, 1):
            mine = [e for e in evs if e.get("rank") == rank]
            assert len([e for e in mine if e["type"] == "step"]) == 5, mine[-3:]
        # Whose each event is, in the merged stream; the job's own events (its alerts, its
        # slowest rank over time) name their ranks instead.
        job_level = ("job_alert", "slowest_over_time")
        assert all("rank" in e for e in evs if e["type"] not in job_level)

        status = run_cli("status", "--job", "jobA", "--json", runtime=runtime_dir)
        # The pretend ranks sleep before each batch: input-bound, a warning, no trouble.
        assert status.returncode == 0, status.stdout + status.stderr
        strict = run_cli("status", "--job", "jobA", "--strict", runtime=runtime_dir)
        assert strict.returncode == 1 and "input-bound" in strict.stdout, strict.stdout
        lines = [json.loads(line) for line in status.stdout.splitlines()]
        assert [line["job"] for line in lines if "findings" in line] == ["jobA"]
        assert sorted(line["rank"] for line in lines if "rank" in line) == [0, 1]

        ls = run_cli("ls", "--job", "jobA", "--json", runtime=runtime_dir)
        assert ls.returncode == 0, ls.stderr
        listed = [json.loads(line) for line in ls.stdout.splitlines()]
        assert sorted((r["job"], r["rank"]) for r in listed) == [("jobA", 0), ("jobA", 1)]

        for argv in (
            ("dump", "--job", "nosuch"),
            ("status", "--job", "nosuch"),
            ("ls", "--job", "nosuch"),
            ("dump", "--job", "jobA", "some-run"),
        ):
            bad = run_cli(*argv, runtime=runtime_dir)
            assert bad.returncode == 2, (argv, bad.stderr)
            assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
            assert "job" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_name_the_ranks_of_one_job_share_is_the_job(runtime_dir: Path) -> None:
    """torchrun starts every rank under the script's name: ``tdbg dump NAME``, ``tdbg status
    NAME``, ``tdbg report NAME`` and ``tdbg alerts NAME`` mean the job, as ``--job`` does; two
    jobs sharing a name are still named, not mixed."""
    with ExitStack() as stack:
        for rank in (0, 1):
            stack.enter_context(pretend_rank(runtime_dir, "jobA", rank, 2, name="train"))
        for job in ("jobB", "jobC"):
            stack.enter_context(pretend_rank(runtime_dir, job, 0, 1, name="shared"))
        wait_until(lambda: len(discover(runtime_dir)) == 4, 120, "four probes serving")

        dump = run_cli("dump", "train", "--count", "3", runtime=runtime_dir)
        assert dump.returncode == 0, dump.stderr
        evs = events(dump.stdout)
        hellos = [e for e in evs if e["type"] == "hello"]
        assert sorted(h["rank"] for h in hellos) == [0, 1]
        assert {h["run"]["job"] for h in hellos} == {"jobA"}
        for rank in (0, 1):
            assert len([e for e in evs if e.get("rank") == rank and e["type"] == "step"]) == 3

        status = run_cli("status", "train", "--json", runtime=runtime_dir)
        assert status.returncode in (0, 1), status.stderr  # 1: a rank judged unhealthy
        lines = [json.loads(line) for line in status.stdout.splitlines()]
        assert [line["job"] for line in lines if "findings" in line] == ["jobA"]
        assert sorted(line["rank"] for line in lines if "rank" in line) == [0, 1]

        report = run_cli("report", "train", "--json", runtime=runtime_dir)
        assert report.returncode == 0, report.stderr
        diagnosis = json.loads(report.stdout)
        assert diagnosis["job"] == "jobA" and sorted(diagnosis["ranks"]) == ["0", "1"]

        alerts = run_cli("alerts", "train", "--timeout", "3", runtime=runtime_dir)
        assert alerts.returncode == 0 and alerts.stderr == "", alerts.stderr  # not "2 runs named"

        for argv, said in (
            (("alerts", "shared"), "tdbg: error: 2 runs named shared, name one: "),
            (("dump", "shared"), "tdbg: error: 2 runs named shared, name one: "),
            (("status", "shared"), "tdbg: error: 2 runs named shared, name one: "),
            (("dump", "--job", "jobA", "train"), "tdbg: error: --job names the runs: give no"),
        ):
            bad = run_cli(*argv, runtime=runtime_dir)
            assert bad.returncode == 2, (argv, bad.stderr)
            assert bad.stderr.startswith(said) and bad.stderr.count("\n") == 1, bad.stderr


def _unreachable_rank(runtime: Path, like: dict, job: str, rank: int, kind: str) -> Path:
    """A rank discovery lists (its metadata names a live pid: this test's) that cannot be
    reached: ``stale``, a socket file nobody listens on (a rank killed before it could remove
    it), or ``file``, a plain file where its socket should be."""
    path = runtime / f"{rank}-{job}-{kind}.sock"
    if kind == "stale":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(path))  # bound, never listening, closed: connect is refused
    else:
        path.write_text("not a socket\n")
    meta = dict(like, job=job, rank=rank, local_rank=rank, pid=os.getpid(), socket=str(path))
    meta["name"] = f"rank{rank}"
    (runtime / f"{path.name}.json").write_text(json.dumps(meta))
    return path


@pytest.mark.slow
def test_an_unreachable_rank_is_one_line_and_the_others_are_still_dumped(
    runtime_dir: Path,
) -> None:
    with ExitStack() as stack:
        for rank in (0, 1):
            stack.enter_context(pretend_rank(runtime_dir, "jobA", rank, 4))
        wait_until(lambda: len(discover(runtime_dir)) == 2, 120, "two probes serving")
        like = discover(runtime_dir)[0].meta
        _unreachable_rank(runtime_dir, like, "jobA", 2, "stale")
        _unreachable_rank(runtime_dir, like, "jobA", 3, "file")
        _unreachable_rank(runtime_dir, like, "jobC", 0, "stale")
        assert len(discover(runtime_dir)) == 5  # listed: the pid is alive, the file is there

        dump = run_cli("dump", "--job", "jobA", "--count", "3", runtime=runtime_dir)
        assert dump.returncode == 0, dump.stderr
        evs = events(dump.stdout)
        for rank in (0, 1):
            steps = [e for e in evs if e.get("rank") == rank and e["type"] == "step"]
            assert len(steps) == 3, evs[-3:]
        assert not [e for e in evs if e.get("rank") in (2, 3)]
        lines = dump.stderr.splitlines()
        assert len(lines) == 2 and "Traceback" not in dump.stderr, dump.stderr
        assert lines[0].startswith("tdbg: error: rank 2: ") and "refused" in lines[0], lines
        assert lines[1].startswith("tdbg: error: rank 3: "), lines

        status = run_cli("status", "--job", "jobA", "--json", runtime=runtime_dir)
        assert status.returncode == 1, status.stderr  # a rank of the job cannot be read
        shown = [json.loads(line) for line in status.stdout.splitlines()]
        assert sorted(line["rank"] for line in shown if "rank" in line) == [0, 1]
        assert [
            line["missing_ranks"] for line in shown if "job" in line and "findings" in line
        ] == [[2, 3]]
        lines = status.stderr.splitlines()
        assert [line.split(": ")[:3] for line in lines] == [
            ["tdbg", "error", "rank 2"],
            ["tdbg", "error", "rank 3"],
        ], status.stderr

        ls = run_cli("ls", "--job", "jobA", "--json", runtime=runtime_dir)
        assert ls.returncode == 0, ls.stderr  # it lists what discovery sees, reaching none
        assert sorted(json.loads(line)["rank"] for line in ls.stdout.splitlines()) == [0, 1, 2, 3]

        none = run_cli("dump", "--job", "jobC", runtime=runtime_dir)
        assert none.returncode == 2 and none.stdout == "", none.stderr
        lines = none.stderr.splitlines()
        assert lines[0].startswith("tdbg: error: rank 0: ") and "refused" in lines[0], lines
        assert lines[1:] == ["tdbg: error: no rank of job jobC could be reached"], lines
        none = run_cli("status", "--job", "jobC", runtime=runtime_dir)
        assert none.returncode == 2 and none.stdout == "", none.stderr
        assert none.stderr.splitlines()[1:] == ["tdbg: error: no rank of job jobC could be reached"]


# x86_64 and aarch64 syscall numbers: tgkill (a signal to one thread of another process), and
# futex (what a thread blocked in a Python lock wait is inside).
SYSCALLS = {"x86_64": (234, 202), "aarch64": (131, 98)}


def _signal_thread(pid: int, tid: int, sig: int) -> None:
    tgkill, _ = SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(tgkill, pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


def _in_futex(pid: int, tid: int) -> bool:
    _, futex = SYSCALLS[platform.machine()]
    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        return f.read().split()[0] == str(futex)


@pytest.mark.slow
@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in SYSCALLS, reason="Linux tgkill"
)
def test_ctrl_c_on_any_thread_stops_the_dump_of_a_stalled_job(runtime_dir: Path) -> None:
    """The kernel may hand a terminal's Ctrl-C to any thread of `tdbg dump --job J --follow`;
    Python only flags it for the main thread. With the job stalled (no event comes) the main
    thread waited for the next event with no timeout and never saw the flag: the dump ignored
    Ctrl-C until the job moved again. Here the SIGINT goes to a reader thread on purpose."""
    with pretend_rank(runtime_dir, "jobS", 0, 2) as rank:
        wait_until(lambda: len(discover(runtime_dir)) == 1, 120, "the rank serving")
        dump = subprocess.Popen(
            [*TDBG, "dump", "--job", "jobS", "--follow"],
            env=dict(os.environ, TDBG_RUNTIME_DIR=str(runtime_dir)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out = dump.stdout
            assert out is not None
            wait_until(lambda: '"step"' in out.readline(), 60, "the dump following the job")
            os.kill(rank.pid, signal.SIGSTOP)  # the job stalls
            # Its last steps drained, the main thread waits for the next event in a lock wait.
            wait_until(lambda: _in_futex(dump.pid, dump.pid), 60, "the dump waiting for events")
            readers = sorted(int(t) for t in os.listdir(f"/proc/{dump.pid}/task"))[1:]
            assert readers, "the dump reads each rank on a thread of its own"
            _signal_thread(dump.pid, readers[0], signal.SIGINT)
            _, err = dump.communicate(timeout=60)
            assert dump.returncode == 130, err
            assert "Traceback" not in err, err
        finally:
            os.kill(rank.pid, signal.SIGCONT)
            if dump.poll() is None:
                dump.kill()
                dump.communicate()
