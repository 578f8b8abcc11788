"""The slowest rank over time, from synthetic per-rank step streams: noise names nobody, a rank
slow in most windows is persistent, one that comes and goes is intermittent, a rank that dies no
longer holds the record back, and the state stays bounded at 1,024 ranks and long runs."""

from __future__ import annotations

from pathlib import Path

from straggler_streams import intermittent, job_of, noise, record, run

from tdbg.model.diagnosis import diagnose_job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.recordings import load_job
from tdbg.model.straggler_history import SPAN, WINDOW, StragglerHistory
from tdbg.protocol.framing import pack
from tdbg.protocol.steps import pack_steps
from tdbg.tui.sources.synthetic import RUN


def test_noise_names_no_straggler_though_the_slowest_rank_changes_every_step() -> None:
    for ranks in (2, 8):
        job, history = job_of(ranks), StragglerHistory()
        run(job, history, range(600), noise(ranks))
        assert history.span == SPAN * WINDOW
        assert history.named() == []
        assert history.line() == f"no rank repeatedly the slowest in the last {SPAN * WINDOW} steps"


def test_a_rank_slow_in_most_windows_is_named_persistent_with_its_phase() -> None:
    job, history = job_of(4), StragglerHistory()
    base = noise(1)
    run(job, history, range(400), lambda r, s: base(r, s) + (0.030 if r == 2 else 0.0))
    [named] = history.named()
    assert named.rank == 2 and named.kind == "persistent"
    assert named.share > 0.9 and named.spells == 1 and named.ongoing
    line = history.line()
    assert line.startswith("rank 2 (persistent): the slowest in ")
    assert "1 spell of " in line and "still on; input wait" in line


def test_a_rank_that_comes_and_goes_is_named_intermittent_with_its_spells() -> None:
    job, history = job_of(4), StragglerHistory()
    run(job, history, range(700), intermittent(3, 150, 60))
    [named] = history.named()
    assert named.rank == 3 and named.kind == "intermittent"
    assert named.spells >= 3
    # Each spell lasts about its 60 slow steps (the 20-step median lags it by ~10 steps).
    assert 40 <= named.longest <= 80
    assert 0.25 <= named.share <= 0.55
    line = history.line()
    assert line.startswith(f"rank 3 (intermittent): the slowest in {round(100 * named.share)} % ")
    assert f"in {named.spells} spells, the longest {named.longest} steps" in line
    assert line.endswith("; input wait")
    # Over the whole run (since the first window judged), beyond the recent span too.
    assert named.total_spells >= named.spells and named.total_steps >= named.steps


def test_a_straggler_that_died_is_named_earlier_and_no_longer_holds_the_record_back() -> None:
    job, history = job_of(4), StragglerHistory()
    slow = lambda r, s: 0.002 + (0.030 if r == 1 else 0.0)  # noqa: E731
    run(job, history, range(200), slow)
    job.ranks[1].mark("ended", "exit 1: RuntimeError")
    run(job, history, range(200, 450), slow)  # the others go on without it
    assert history.recent[-1].end == 450  # judged up to the others' step: not waiting for rank 1
    [named] = history.named()
    assert named.rank == 1 and named.kind == "earlier" and not named.ongoing
    assert named.last == 199 or named.last == 209  # its last window: its steps ended at 199
    assert "(steps " in history.line()


def test_a_rank_that_stops_without_ending_holds_the_windows_back() -> None:
    # A hung rank (no goodbye): the others' windows past its step wait for it, as DDP does.
    job, history = job_of(3), StragglerHistory()
    run(job, history, range(100), noise(3))
    judged = history.judged
    for rank in (0, 1):
        job.ranks[rank].apply(pack_steps([record(s, 0.002) for s in range(100, 200)], 0))
    assert history.update(job) == 0 and history.judged == judged


def test_too_few_steps_are_no_verdict_yet() -> None:
    job, history = job_of(2), StragglerHistory()
    run(job, history, range(60), lambda r, s: 0.002 + 0.03 * r)
    assert history.named() == []
    assert history.line().startswith("judged once 100 steps are in (")


def test_a_job_first_seen_mid_run_is_judged_over_its_last_span_only() -> None:
    # Bounded work a frame: a 5,000-step backlog is not judged window by window.
    job, history = job_of(3), StragglerHistory()
    for rank, state in job.ranks.items():
        state.apply(pack_steps([record(s, 0.002 + 0.03 * (rank == 0)) for s in range(5000)], 0))
    assert history.update(job) == SPAN
    assert history.since == 5000 - SPAN * WINDOW
    assert history.named()[0].rank == 0


def test_a_restarted_job_is_judged_again_from_its_new_steps() -> None:
    job, history = job_of(2), StragglerHistory()
    run(job, history, range(300), lambda r, s: 0.002 + 0.03 * (r == 1))
    before = history.judged
    restarted = job_of(2)  # every rank back at step 0 (a new hello each)
    job.ranks = restarted.ranks
    run(job, history, range(200), lambda r, s: 0.002 + 0.03 * (r == 1))
    assert history.judged > before + 10


def test_1024_ranks_keep_bounded_state_and_name_the_intermittent_rank() -> None:
    ranks = 1024
    job, history = job_of(ranks), StragglerHistory()
    pattern = intermittent(700, 100, 40)
    run(job, history, range(260), pattern, batch=20)
    [named] = history.named()
    assert named.rank == 700 and named.kind == "intermittent"
    # O(ranks) at most: a tally per rank ever the slowest, and SPAN windows.
    assert len(history.tallies) <= 2 and len(history.recent) <= SPAN


def test_state_does_not_grow_with_steps() -> None:
    job, history = job_of(2), StragglerHistory()
    run(job, history, range(3000), intermittent(1, 200, 50), batch=50)
    assert len(history.recent) == SPAN and list(history.tallies) == [1]
    assert history.judged > 250


def test_job_alerts_feed_the_history_as_they_judge() -> None:
    job, alerts = job_of(3), JobAlerts()
    for first in range(0, 300, 10):
        for rank, state in job.ranks.items():
            slow = 0.03 * (rank == 2)
            state.apply(pack_steps([record(s, 0.002 + slow) for s in range(first, first + 10)], 0))
        alerts.update(job, now=float(first))
    assert alerts.history.named()[0].rank == 2
    data = alerts.history.to_json()
    assert data["ranks"][0]["kind"] == "persistent" and data["ranks"][0]["phases"] == {
        "input wait": data["ranks"][0]["steps"] // WINDOW
    }


def test_each_value_is_compared_with_the_median_of_the_others() -> None:
    import numpy as np

    from tdbg.model.job import others_medians

    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 7, 10):
        values = rng.integers(0, 5, n).astype(float)  # ties too
        expected = [np.median(np.delete(values, k)) for k in range(n)]
        assert np.allclose(others_medians(values), expected)


def test_a_job_whose_ranks_all_ended_is_judged_whole() -> None:
    # A job read from its recordings: every rank ended, none holds the windows back.
    job, history = job_of(3), StragglerHistory()
    run(job, None, range(300), intermittent(2, 100, 40), batch=50)
    for state in job.ranks.values():
        state.mark("ended", "shutdown")
    assert history.update(job) == 30
    assert [(r.rank, r.kind) for r in history.named()] == [(2, "intermittent")]


def test_a_jobs_recordings_replayed_keep_the_record_and_the_report_names_it(
    tmp_path: Path,
) -> None:
    # The record is rebuilt from what every recording keeps (the ranks' step timings), as the
    # replayed job screen and `tdbg report --job` read it.
    from tdbg.probe.serving.recorder import Recorder  # the real writer: what a run records

    pattern = intermittent(1, 150, 60)
    for rank in range(3):
        run_info = dict(RUN, rank=rank, world_size=3, job="recjob", pid=100 + rank)
        rec = Recorder(tmp_path / f"train.rank{rank}.tdbg", run_info, ["w"], [1])  # type: ignore[arg-type]
        assert rec.open()
        for first in range(0, 600, 20):
            msg = pack_steps([record(s, pattern(rank, s)) for s in range(first, first + 20)], 0)
            rec.add_steps(msg, pack(msg))
        rec.close()
    job, alerts = load_job(tmp_path)
    [named] = alerts.history.named()
    assert (named.rank, named.kind) == (1, "intermittent")
    assert alerts.history.since == 0 and alerts.history.judged == 60
    report = diagnose_job(job, alerts)
    [finding] = [f for f in report.findings if f.headline.startswith("slowest over time: ")]
    assert finding.headline == f"slowest over time: {named.words()}" and finding.level == "warn"
    assert finding.evidence == [
        f"since step 0: the slowest for {named.total_steps} of 600 steps judged, in "
        f"{named.total_spells} spells, the longest {named.total_longest} steps"
    ]
