"""The slowest rank over time, from synthetic per-rank step streams: noise names nobody, a rank
slow in most windows is persistent, one that comes and goes is intermittent, a rank that dies no
longer holds the record back, and the state stays bounded at 1,024 ranks and long runs."""

from __future__ import annotations

from straggler_streams import intermittent, job_of, noise, record, run

from tdbg.model.job_alerts import JobAlerts
from tdbg.model.straggler_history import SPAN, WINDOW, StragglerHistory
from tdbg.protocol.steps import pack_steps


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
