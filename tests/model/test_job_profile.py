"""`p` on the job screen as plain state: one profile sent to every rank, each rank's answer read
from its own deep-dive state (done, running, refused, ended, not sent), and the view of it."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from tdbg.model.job import Job
from tdbg.model.job_profile import JobProfile
from tdbg.model.run_state import RunState
from tdbg.tui.screens.job_profile import job_profile_view

ARGS = {"steps": 5, "max_seconds": 30.0}


def _profile(wall: float, rows: list[tuple[str, float]]) -> dict[str, Any]:
    return {
        "rows": [{"name": n, "calls": 5, "self_cpu": t, "cpu_total": t} for n, t in rows],
        "steps": [10, 14],
        "wall_seconds": wall,
        "sort": "cpu_total",
    }


def _job(*ranks: int) -> Job:
    return Job("j", {rank: RunState({"rank": rank}) for rank in ranks})


def _ack(state: RunState, mid: int, job: int) -> None:
    state.apply({"type": "ack", "id": mid, "command": "profile", "job": job})


def _state(state: RunState, job: int, name: str, **extra: Any) -> None:
    state.apply({"type": "job", "job": job, "command": "profile", "state": name, **extra})


def _text(profile: JobProfile, job: Job) -> str:
    console = Console(width=76, record=True, color_system=None)
    console.print(job_profile_view(profile, job))
    return console.export_text()


def test_progress_then_the_comparison_with_each_rank_that_has_no_profile_named() -> None:
    job = _job(0, 1, 2, 3)
    profile = JobProfile(ARGS, unsent={4: "not running (exit 1)"})
    for rank in (0, 1, 2, 3):
        job.ranks[rank].sent(7, "profile", ARGS)
        profile.sent[rank] = 7
    _ack(job.ranks[0], 7, 3)
    _state(job.ranks[0], 3, "running", done=2, total=5, step=12)
    answers = profile.answers(job)
    assert profile.progress(answers) == "profiling 5 ranks: 1 done" and not profile.finished(
        answers
    )
    assert "rank 0: profile #3: running 2/5 steps (step 12)" in _text(profile, job)

    slow = _profile(0.5, [("gloo:all_reduce", 10_000.0), ("aten::addmm", 400_000.0)])
    fast = _profile(0.5, [("gloo:all_reduce", 300_000.0), ("aten::addmm", 100_000.0)])
    _state(job.ranks[0], 3, "done", result=fast)
    _ack(job.ranks[1], 7, 2)
    _state(job.ranks[1], 2, "done", result=slow)
    job.ranks[2].apply({"type": "error", "id": 7, "code": "BUSY", "message": "a profile runs"})
    job.ranks[3].mark("ended", "exit 1: RuntimeError: boom")
    answers = profile.answers(job)
    assert profile.finished(answers) and profile.progress(answers) == "profiling 5 ranks: 5 done"
    assert [a.error for a in answers if a.result is None] == [
        "refused: BUSY: a profile runs",
        "ended before its profile finished (exit 1: RuntimeError: boom)",
        "not running (exit 1)",
    ]
    text = _text(profile, job)
    assert "slowest rank 1: steps 10-14" in text and "fastest rank 0: steps 10-14" in text
    assert "rank 2: no profile: refused: BUSY: a profile runs" in text
    assert "rank 4: no profile: not running (exit 1)" in text
    addmm = next(line for line in text.splitlines() if line.split()[:1] == ["aten::addmm"])
    assert addmm.split() == ["aten::addmm", "80ms", "20ms", "+60ms"], addmm
    # The panel's inside on an 80-column terminal: the op table fits it.
    assert max(len(line) for line in text.splitlines()) <= 76


def test_a_rank_that_restarted_or_failed_has_no_profile_and_none_answered_is_said() -> None:
    job = _job(0, 1)
    profile = JobProfile(ARGS, sent={0: 1, 1: 1})
    job.ranks[1].sent(1, "profile", ARGS)
    _ack(job.ranks[1], 1, 9)
    _state(job.ranks[1], 9, "failed", message="profiler unavailable")
    answers = profile.answers(job)
    assert [a.error for a in answers] == [
        "restarted before it answered",
        "profile #9: failed: profiler unavailable",
    ]
    assert "no rank answered" in _text(profile, job)
