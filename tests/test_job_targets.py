"""`--job JOB` on `tdbg dump`, `tdbg status` and `tdbg ls`: a job's local ranks as the targets,
each event and line saying its rank; another job's ranks never mixed in; bad use one line."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
from jobs import pretend_rank
from test_cli import events, run_cli
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
        assert all("rank" in e for e in evs)  # whose each event is, in the merged stream

        status = run_cli("status", "--job", "jobA", "--json", runtime=runtime_dir)
        assert status.returncode in (0, 1), status.stderr
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
