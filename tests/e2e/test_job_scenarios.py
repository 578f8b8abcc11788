"""The issue's scenarios as live job alerts, with real `torchrun` and gloo: a straggler and a
diverged rank (the ranks' recordings fed to the job step by step, as the job screen gets them),
and a hang named on the job screen with the collective and every rank's stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fresh_runtime_dir
from processes import torchrun_job
from waiting import wait_for, wait_until

from tdbg.cli.tui_entry import _job_recordings
from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlert, JobAlerts
from tdbg.model.job_replay import replay_job
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import pack_steps, unpack_steps
from tdbg.recording.reader import Recording
from tdbg.tui.app import screen_text
from tdbg.tui.job_app import JobApp
from tdbg.tui.screens.job import RankScreen
from tdbg.tui.sources.job import JobSource
from tdbg.tui.sources.job_replay import RecordedJobSource
from tdbg.tui.widgets.rank_table import RankTable


def replay_as_live(files: list[Path]) -> tuple[JobAlerts, list[JobAlert]]:
    """Each rank's recorded steps fed one step at a time on every rank, the job judged after each
    (the order a live job screen sees them in); the alerts and every raise/clear event."""
    job, alerts = Job("", {}), JobAlerts()
    steps_by_rank = {}
    for rank, path in enumerate(files):
        recording = Recording(path)
        state = RunState(dict(recording.run))
        messages = list(recording.messages())
        for message in messages:
            if message.get("type") == "layers":
                state.apply(message)
        steps_by_rank[rank] = [
            r for m in messages if m.get("type") == "steps" for r in unpack_steps(m)
        ]
        job.ranks[rank] = state
    events: list[JobAlert] = []
    for i in range(min(len(s) for s in steps_by_rank.values())):
        for rank, state in job.ranks.items():
            state.apply(pack_steps([steps_by_rank[rank][i]], len(state.layer_names)))
        events += alerts.update(job)
    return alerts, events


@pytest.mark.slow
def test_a_straggler_and_a_diverged_rank_raise_their_alerts(straggler_job: list[Path]) -> None:
    """Three gloo ranks under DDP: rank 1 waits 40 ms for each batch, rank 2 changes one layer's
    gradient after the all-reduce."""
    alerts, events = replay_as_live(straggler_job)
    raised = {(a.kind, tuple(a.ranks)): a for a in events if not a.cleared}
    assert set(raised) == {("straggler", (1,)), ("rank_divergence", (2,))}, events
    straggler = raised["straggler", (1,)].as_message().to_wire()
    assert straggler["phase"] == "input wait" and straggler["slower_by"] > 0.02
    assert raised["straggler", (1,)].step <= 20 + 20  # the first window, then within 20 steps
    divergence = raised["rank_divergence", (2,)]
    assert divergence.finding.layers == ["2"] and divergence.step is not None  # DDP: as written
    assert alerts.rule.startswith("applies")
    assert not [a for a in events if a.cleared]  # neither recovered: nothing flapped


@pytest.fixture(scope="module")
def hung_job() -> Iterator[Path]:
    """A 3-rank gloo job whose rank 1 waits (10 minutes) for a batch at step 5 while ranks 0 and
    2 wait for it in the all-reduce; its runtime directory. The job screen's test and `tdbg
    status`'s both only watch the hang, so they share one job (a torchrun job takes 10-25 s)."""
    with (
        fresh_runtime_dir() as sockets,
        torchrun_job(
            3,
            "--grad-every",
            "1",
            DDP_STEPS="1000",
            DDP_HANG_RANK="1",
            TDBG_RUNTIME_DIR=str(sockets),
        ),
    ):
        yield sockets


@pytest.mark.slow
async def test_a_hang_is_named_on_the_job_screen_with_its_collective_and_stacks(
    hung_job: Path,
) -> None:
    """Three gloo ranks; rank 1 waits forever for a batch at step 5 while ranks 0 and 2 wait in
    the all-reduce: the job screen names rank 1, the collective, and where rank 1 is."""
    app = JobApp(JobSource(directory=hung_job))
    async with app.run_test(size=(180, 40)) as pilot:

        def hang() -> JobAlert | None:
            """The hang alert once every rank's stall is in (it is raised as soon as two
            ranks' stalls disagree, and follows the others as they stall)."""
            alert = next((a for a in app.alerts.active.values() if a.kind == "hang"), None)
            return alert if alert is not None and len(alert.finding.stacks) == 3 else None

        alert = await wait_for(pilot, hang, "a hang alert with every rank's stack", 150)
        message = alert.as_message().to_wire()
        assert message["ranks"] == [1]
        collective = message["collective"]
        assert isinstance(collective["seq"], int) and "all" in str(collective["op"]).lower()
        assert set(message["stacks"]) == {"0", "1", "2"}
        assert "wait_for_a_batch_that_never_comes" in message["stacks"]["1"]
        # All of it in one frame: the alert's line and the frame under it are painted as
        # the panel catches up, so wait for every part rather than read after the first.
        parts = ("hang: rank 1 never entered", "ranks 0, 2 wait in", "rank 1 at ")
        await wait_for(
            pilot,
            lambda: all(part in screen_text(app) for part in parts),
            "the hang, who waits, and rank 1's innermost frame on screen",
        )


@pytest.mark.slow
def test_a_hung_job_names_the_rank_that_never_entered_the_collective(
    hung_job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same hang from the shell: each probe's stall alert carries its flight recorder's last
    collective and its stack; `tdbg status` compares them and names rank 1 and where it is."""
    from tdbg.cli.main import run

    monkeypatch.setenv("TDBG_RUNTIME_DIR", str(hung_job))

    def hang_named() -> str | None:
        if len(list(hung_job.glob("*.json"))) < 3:
            return None
        run(["status"])
        out = capsys.readouterr().out
        return out if "ranks 0, 2 wait in" in out else None  # once every rank stalled

    out = wait_until(hang_named, 120.0, "tdbg status naming the hang")
    line = next(x for x in out.splitlines() if "hang:" in x)
    assert "rank 1 never entered collective" in line, out
    assert "ranks 0, 2 wait in" in line
    assert "wait_for_a_batch_that_never_comes" in line or "train_ddp.py" in line


@pytest.mark.slow
async def test_the_ranks_recordings_replay_as_one_job(straggler_job: list[Path]) -> None:
    """`tdbg-tui --job DIR`: a 3-rank torchrun job's recordings (rank 1 straggles, rank 2
    diverges) replayed as one job on the job screen, its alerts judged from the streams."""
    files = straggler_job
    directory = str(files[0].parent)
    assert _job_recordings(directory, []) == files  # the directory: every rank's recording
    app = JobApp(RecordedJobSource("replay"), replay_job(files))
    async with app.run_test(size=(180, 40)) as pilot:
        raised = {(a.kind, tuple(a.ranks)) for a in app.alerts.events if not a.cleared}
        assert raised == {("straggler", (1,)), ("rank_divergence", (2,))}, app.alerts.events

        def both_shown() -> str | None:  # the first frames can still be settling their layout
            text = screen_text(app)
            return (
                text if "straggler: rank 1" in text and "rank_divergence: rank 2" in text else None
            )

        text = await wait_for(pilot, both_shown, "both alerts on the job screen")
        assert "3 of 3 ranks" in text
        table = app.screen.query_one(RankTable)
        first, second = (str(table.get_row_at(i)[0]) for i in range(2))
        assert (first, second) == ("2", "1")  # diverged, then the straggler: worst first
        assert str(table.get_row("0")[-1]) == "ended"  # each recording ran to its end
        await pilot.press("enter")  # a replayed rank opens as any rank does
        await wait_for(pilot, lambda: isinstance(app.screen, RankScreen), "rank 2's screen")
        assert app.send_command("profile") is None  # a recording takes no commands
