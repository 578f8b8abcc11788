"""`tdbg status --job`: the slowest rank over the ranks' recent history, a line and a JSON
field — a rank that comes and goes named intermittent, a steady job naming nobody. The ranks'
states are synthetic step streams read in place of the sockets (the reading is tested apart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from straggler_streams import intermittent, job_of, noise, run

from tdbg.cli import status
from tdbg.cli.main import run as tdbg
from tdbg.connect.runtime import RunEntry
from tdbg.model.job import Job


def serve(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--job j1`` finds ``job``'s ranks, and reading a rank gives its state."""
    entries = [RunEntry(Path(f"/nowhere/r{r}.sock"), {"rank": r}) for r in job.ranks]
    by_socket = {str(e.socket): job.ranks[r] for e, r in zip(entries, job.ranks, strict=True)}
    monkeypatch.setattr(status, "job_entries_for", lambda args, targets: entries)
    monkeypatch.setattr(status, "read_state", lambda text, args: by_socket[text])


def test_status_names_a_rank_that_comes_and_goes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_of(4)
    run(job, None, range(700), intermittent(3, 150, 60), batch=50)
    serve(job, monkeypatch)
    tdbg(["status", "--job", "j1"])
    lines = capsys.readouterr().out.splitlines()
    [line] = [x for x in lines if x.startswith("  slowest over time: ")]
    assert line.startswith("  slowest over time: rank 3 (intermittent): the slowest in "), line
    assert "% of the last 500 steps, in " in line and line.endswith("; input wait")

    tdbg(["status", "--job", "j1", "--json"])
    [job_line] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"findings"' in x]
    slowest = job_line["slowest"]
    assert slowest["span"] == 500 and slowest["window"] == 10
    [rank3] = slowest["ranks"]
    assert rank3["rank"] == 3 and rank3["kind"] == "intermittent" and rank3["spells"] >= 3
    assert rank3["phases"] == {"input wait": rank3["steps"] // 10}
    assert slowest["line"] == line.removeprefix("  slowest over time: ")


def test_status_names_nobody_in_a_steady_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_of(3)
    run(job, None, range(300), noise(5), batch=50)
    serve(job, monkeypatch)
    tdbg(["status", "--job", "j1"])
    out = capsys.readouterr().out
    assert "  slowest over time: no rank repeatedly the slowest in the last 300 steps\n" in out
