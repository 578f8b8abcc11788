"""Live job alerts from synthetic per-rank step streams: a straggler is named within 20 steps of
its onset, noise does not flap, recovery clears; divergence says when its rule applies; a hang
names the rank behind within its own process group."""

from __future__ import annotations

import random

from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlert, JobAlerts
from tdbg.model.run_state import RunState
from tdbg.protocol.messages import alert_message
from tdbg.protocol.steps import StepRecord, pack_steps

LAYERS = ["0", "2"]
NAN = float("nan")


def job_of(ranks: int, layers: list[list[str]] | None = None) -> Job:
    states = {}
    for rank in range(ranks):
        state = RunState({"name": "t", "rank": rank, "world_size": ranks, "job": "j1"})
        names = (layers or [LAYERS] * ranks)[rank]
        state.apply({"type": "layers", "names": names, "numel": [10] * len(names)})
        states[rank] = state
    return Job("j1", states)


def record(step: int, data: float, compute: float = 0.010, backward: float = 0.005) -> StepRecord:
    """A step whose own work is ``data + compute``; backward holds the all-reduce wait."""
    return StepRecord(
        step=step,
        time=float(step),
        loss=1.0,
        step_time=data + compute + backward,
        data_time=data,
        forward_time=compute,
        backward_time=backward,
        optimizer_time=0.0,
    )


def feed(job: Job, alerts: JobAlerts, step: int, data_by_rank: dict[int, float]) -> list[JobAlert]:
    """One step on every rank, then the job judged, as the job screen does after a batch."""
    for rank, state in job.ranks.items():
        state.apply(pack_steps([record(step, data_by_rank.get(rank, 0.001))], 0))
    return alerts.update(job, now=float(step))


def test_a_straggler_is_named_within_20_steps_of_onset_with_its_phase() -> None:
    job, alerts = job_of(4), JobAlerts()
    for step in range(30):
        assert not feed(job, alerts, step, {})
    onset = 30
    raised: list[JobAlert] = []
    for step in range(onset, onset + 40):
        raised += feed(job, alerts, step, {2: 0.040})
        if raised:
            break
    assert [a.kind for a in raised] == ["straggler"]
    alert = raised[0]
    assert alert.ranks == [2] and alert.step - onset <= 20
    message = alert.as_message().to_wire()
    assert message["ranks"] == [2] and message["phase"] == "input wait"
    assert 0.030 < message["slower_by"] < 0.050
    assert "rank 2 holds the others up" in alert.message and "input wait" in alert.message
    assert alerts.ranks_alerted() == {2: ["straggler"]}


def test_a_straggler_is_named_from_the_few_steps_a_gpu_run_times() -> None:
    """Under data parallelism every rank's step takes as long as the slowest's (the others
    wait in backward); a GPU run with short steps times the phases of one step in ten. The
    straggler is still named, with its phase, from those steps (its whole step time, which
    every rank shares, says nothing)."""
    job, alerts = job_of(4), JobAlerts()
    onset, raised = 200, []

    def feed_ddp(step: int) -> list[JobAlert]:
        own = {rank: 0.011 + (0.040 if rank == 2 and step >= onset else 0.0) for rank in job.ranks}
        slowest = max(own.values())
        for rank, state in job.ranks.items():
            r = record(step, own[rank] - 0.010, backward=0.005 + slowest - own[rank])
            if (step + rank) % 10:  # each rank times its own one step in ten
                r.data_time = r.forward_time = r.backward_time = r.optimizer_time = NAN
            state.apply(pack_steps([r], 0))
        return alerts.update(job, now=float(step))

    for step in range(onset):
        assert not feed_ddp(step)
    for step in range(onset, onset + 300):
        raised += feed_ddp(step)
        if raised:
            break
    assert [a.kind for a in raised] == ["straggler"] and raised[0].ranks == [2]
    # within the ~10 timed steps the median takes to turn (about 100 steps of ~10 ms)
    assert raised[0].step - onset <= 150
    message = raised[0].as_message().to_wire()
    assert message["phase"] == "input wait", message
    # named as soon as half its recent timed steps are slow (0.040 s each): the median between
    assert 0.015 < message["slower_by"] < 0.050, message


def test_ranks_that_time_their_steps_at_different_rates_are_not_stragglers() -> None:
    """Identical ranks under data parallelism, their steps' phases timed one in 2, 2 and 3
    steps: while one has too few timed steps its whole step (the all-reduce wait in it) is
    never weighed against the others' own work."""
    job, alerts = job_of(3), JobAlerts()
    gaps = {0: 2, 1: 2, 2: 3}
    for step in range(80):
        for rank, state in job.ranks.items():
            r = record(step, 0.001, compute=0.003, backward=0.006)
            if step % gaps[rank]:
                r.data_time = r.forward_time = r.backward_time = r.optimizer_time = NAN
            state.apply(pack_steps([r], 0))
        assert not alerts.update(job, now=float(step)), step


def test_noise_does_not_flap_and_recovery_clears_once() -> None:
    rng = random.Random(7)
    job, alerts = job_of(3), JobAlerts()
    events: list[JobAlert] = []
    # Every rank jitters (±40 % of its input wait), one step in ten is a 3x spike on some rank,
    # and every 50 steps one rank has a burst of 8 slow steps (a GC pause, a busy disk).
    for step in range(300):
        data = {r: 0.004 * rng.uniform(0.6, 1.4) for r in range(3)}
        if rng.random() < 0.1:
            data[rng.randrange(3)] *= 3
        if step % 50 < 8:
            data[(step // 50) % 3] += 0.030
        events += feed(job, alerts, step, data)
    assert events == []
    # A real straggler that then recovers: one raise, one clear, nothing in between.
    for step in range(300, 360):
        data = {r: 0.004 * rng.uniform(0.6, 1.4) for r in range(3)}
        data[1] += 0.030
        events += feed(job, alerts, step, data)
    for step in range(360, 430):
        events += feed(job, alerts, step, {r: 0.004 * rng.uniform(0.6, 1.4) for r in range(3)})
    assert [(a.kind, a.ranks, a.cleared) for a in events] == [
        ("straggler", [1], False),
        ("straggler", [1], True),
    ]
    cleared = events[1]
    assert cleared.severity == "info" and cleared.as_message().to_wire()["cleared"] is True
    assert "rank 1 caught up" in cleared.message
    assert alerts.active == {} and alerts.events[0] is cleared


def test_a_straggler_hovering_at_the_threshold_is_raised_once_and_not_flapped() -> None:
    """Rank 1 alternates between 1.3x and 1.2x the others' work: raised once, never cleared
    (it stays above the lower bar), never raised again."""
    job, alerts = job_of(3), JobAlerts()
    events: list[JobAlert] = []
    for step in range(240):
        extra = 0.3 if (step // 30) % 2 == 0 else 0.2
        for rank, state in job.ranks.items():
            data = 0.001 + (extra * 0.021 if rank == 1 else 0.0)
            state.apply(pack_steps([record(step, data, compute=0.020)], 0))
        events += alerts.update(job, now=float(step))
    assert [(a.kind, a.ranks, a.cleared) for a in events] == [("straggler", [1], False)]


def test_divergence_names_ranks_layers_and_step_when_the_rule_applies() -> None:
    job, alerts = job_of(3), JobAlerts()
    for step in range(5):
        for rank, state in job.ranks.items():
            norms = [1.0, 2.0 + (0.5 if rank == 2 and step >= 3 else 0.0)]
            state.apply(pack_steps([StepRecord(step, float(step), 1.0, grad_norms=norms)], 2))
    raised = alerts.update(job)
    assert [(a.kind, a.ranks, a.step) for a in raised] == [("rank_divergence", [2], 3)]
    assert raised[0].finding.layers == ["2"]
    assert alerts.rule.startswith("applies: every rank watches the same 2 layers")


def test_divergence_rule_does_not_apply_to_unequal_layer_sets() -> None:
    """FSDP shards or pipeline stages: different layers per rank, so gradients differ by design;
    the job says the rule does not apply and raises nothing."""
    job, alerts = job_of(2, layers=[["0", "2"], ["4", "6"]]), JobAlerts()
    for step in range(5):
        for rank, state in job.ranks.items():
            norms = [1.0 + rank, 5.0 * rank + 1]
            state.apply(pack_steps([StepRecord(step, float(step), 1.0, grad_norms=norms)], 2))
    assert alerts.update(job) == []
    assert alerts.rule.startswith("does not apply")


def stall(seq: int, group: list[str], where: str) -> dict[str, object]:
    message = dict(alert_message("stalled", "warning", 5, f"no step — stuck at {where}", [], 1.0))
    message["stack"] = ["train.py:10 in main: step()", where]
    message["collective"] = {"seq": seq, "op": "gloo:all_reduce", "sizes": [[8]], "group": group}
    return message


def test_a_hang_names_the_rank_behind_within_its_process_group() -> None:
    job, alerts = job_of(3), JobAlerts()
    # Ranks 0 and 2 wait in collective #7 of the default group; rank 1's last is #6 there.
    job.ranks[0].apply(stall(7, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    job.ranks[2].apply(stall(7, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    job.ranks[1].apply(stall(6, ["0", "default_pg"], "train.py:20 in load"))
    raised = alerts.update(job)
    assert [(a.kind, a.ranks) for a in raised] == [("hang", [1])]
    message = raised[0].as_message().to_wire()
    assert message["collective"] == {
        "seq": 7,
        "op": "gloo:all_reduce",
        "sizes": [[8]],
        "group": "0",
    }
    assert (
        set(message["stacks"]) == {"0", "1", "2"}
        and "train.py:20 in load" in message["stacks"]["1"]
    )
    # Rank 1 resumes: the hang clears.
    job.ranks[1].apply(alert_message("resumed", "info", 6, "the loop resumed after 9 s", [], 2.0))
    cleared = alerts.update(job)
    assert [(a.kind, a.ranks, a.cleared) for a in cleared] == [("hang", [1], True)]


def test_sequence_numbers_of_different_process_groups_are_not_compared() -> None:
    """Seq #40 in a subgroup is not ahead of seq #7 in the default group: no hang is named."""
    job, alerts = job_of(2), JobAlerts()
    job.ranks[0].apply(stall(40, ["1", "tp_group"], "dist.py:1 in all_gather"))
    job.ranks[1].apply(stall(7, ["0", "default_pg"], "dist.py:1 in all_reduce"))
    assert alerts.update(job) == []


def test_a_rank_slowed_by_its_evaluation_is_named_with_that_phase() -> None:
    """A rank whose forwards without grad (an evaluation only it runs, a rollout) hold the
    others up: the straggler names the no-grad phase, not an input wait."""
    job, alerts = job_of(3), JobAlerts()
    raised: list[JobAlert] = []
    for step in range(60):
        for rank, state in job.ranks.items():
            slow = rank == 1 and step >= 20
            rec = record(step, 0.001)
            rec.no_grad_time = 0.040 if slow else 0.0
            rec.step_time += rec.no_grad_time
            state.apply(pack_steps([rec], 0))
        raised += alerts.update(job, now=float(step))
        if raised:
            break
    assert [a.kind for a in raised] == ["straggler"] and raised[0].ranks == [1]
    assert raised[0].as_message().to_wire()["phase"] == "no-grad forwards (evaluation)"
    assert "input wait" not in raised[0].message


def test_a_straggler_slow_all_through_the_history_is_named_on_the_first_judgement() -> None:
    """A viewer that attaches to a job whose rank 2 has been slow for 100 steps names it at
    once (the record's spell spans the rule's window); a rank slow for the last 10 steps only
    still waits ONSET_STEPS."""
    job, alerts = job_of(4), JobAlerts()
    for rank, state in job.ranks.items():
        data = 0.040 if rank == 2 else 0.001
        state.apply(pack_steps([record(step, data) for step in range(100)], 0))
    raised = alerts.update(job, now=0.0)
    assert [(a.kind, a.ranks) for a in raised] == [("straggler", [2])]

    late, alerts = job_of(4), JobAlerts()
    for rank, state in late.ranks.items():
        steps = [record(s, 0.040 if rank == 2 and s >= 90 else 0.001) for s in range(100)]
        state.apply(pack_steps(steps, 0))
    assert alerts.update(late, now=0.0) == []
