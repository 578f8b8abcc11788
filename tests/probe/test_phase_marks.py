"""A GPU run's phase timing: CUDA events on one short step in a few, every long step's; proven on
the CPU with a fake CUDA event at the library boundary (no CUDA here; gpu_check.py runs the
real events)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Loop, handed_over

import tdbg
from tdbg.probe.training import cost_model
from tdbg.probe.training.histograms import LayerHistograms
from tdbg.probe.training.hooks import CudaMark
from tdbg.probe.training.update_ratio import UpdateRatios
from tdbg.protocol.steps import MAX_PHASE_GAP

PHASES = ("data_time", "forward_time", "backward_time", "optimizer_time")


class FakeEvent:
    """What the probe uses of a recorded CUDA event: timed on the host clock, done at once (or,
    while ``busy``, not done: a device still working through what was queued)."""

    made = 0
    busy = False

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.at = time.perf_counter()

    def query(self) -> bool:
        return not FakeEvent.busy

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


def fake_cuda_mark() -> CudaMark:
    return CudaMark(time.perf_counter(), FakeEvent())


def on_a_fake_gpu(probe: Any) -> None:
    """The probe as it is on a GPU run, where its marks are concerned: the sampler plans its
    marks per step and makes CUDA ones on the steps it times."""
    sampler = probe._sampler
    sampler._cuda_device = torch.device("cuda", 0)
    sampler._cuda_mark = sampler._mark = probe._hooks._mark = fake_cuda_mark
    probe._hooks.host_marks = False


def run_steps(monkeypatch: pytest.MonkeyPatch, steps: int, timed_from: float) -> list[Any]:
    """The records of ``steps`` steps of a real loop watched as on a GPU, every step of which
    is shorter than ``timed_from`` seconds or not, as the test sets it; and the loop's losses."""
    monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", timed_from)
    loop = Loop(seed=3)
    probe = tdbg.watch(loop.model, loop.opt, name="marks", grad_every=5)
    on_a_fake_gpu(probe)
    sent = handed_over(probe, monkeypatch)
    for _ in range(steps):
        loop.step(probe)
    records = []
    for pending in sent:
        # A timed step's marks are all CUDA ones (its data gap's start too: the step before
        # ended on one), an untimed step's all host times: no span mixes the two clocks.
        tl = pending.timeline
        marks = [tl.forward_start, tl.forward_end, tl.optimizer_start, tl.optimizer_end]
        marks += [pending.previous_end] if pending.step else []
        kind = float if pending.unmarked else CudaMark
        assert all(type(m) is kind for m in marks), (pending.step, marks)
        resolved = pending.resolve()
        assert resolved is not None
        records.append(resolved[0])
    assert [r.step for r in records] == list(range(steps))
    for record, loss in zip(records, loop.losses, strict=True):
        assert record.loss == pytest.approx(loss, rel=1e-6)  # every step's loss, timed or not
    assert all(r.step_time > 0 for r in records[1:])  # and its time
    assert probe.errors == 0
    probe.close()
    return records


def timed_steps(records: list[Any]) -> list[int]:
    timed = []
    for r in records:
        values = [getattr(r, name) for name in PHASES]
        if all(math.isnan(v) for v in values):
            continue
        # A timed step has all four (its data gap from the step before's end; the first
        # step has none): none missing.
        assert all(v >= 0 for v in values[r.step == 0 :]), (r.step, values)
        timed.append(r.step)
    return timed


def test_short_gpu_steps_time_their_phases_once_in_a_few_steps(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps far shorter than the threshold: the first two (the step's length not known yet)
    and then one in MAX_MEAN_GAP on average have phase times, never MAX_PHASE_GAP or more
    apart; the others' are NaN, not host times."""
    FakeEvent.made = 0
    extras = 0
    compute = LayerHistograms.compute

    def counted(self: Any) -> Any:
        nonlocal extras
        extras += 1
        return compute(self)

    monkeypatch.setattr(UpdateRatios, "due", lambda self, seconds: False)
    monkeypatch.setattr(LayerHistograms, "compute", counted)
    records = run_steps(monkeypatch, 200, timed_from=1e9)
    timed = timed_steps(records)
    assert timed[:2] == [0, 1]
    distances = [b - a for a, b in zip(timed, [*timed[1:], 200], strict=True)]
    assert max(distances) < MAX_PHASE_GAP
    assert 200 / 32 < len(timed) < 200 / 8  # one in 16 on average: ~14
    # 4 events on a timed step and 1 ending the step before it (its data gap's start; none
    # before step 0), 2 around each gradient pass (every 5th step): none on an untimed step
    # (the loss here is a CPU tensor: no copy, no copy event).
    # (Each pass that also copied the weights or counted histograms ends on one more: the
    # first passes count histograms; `extras` says how many did.)
    assert FakeEvent.made == 4 * len(timed) + len(timed) - 1 + 2 * 40 + extras


def test_long_gpu_steps_time_every_step(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = run_steps(monkeypatch, 30, timed_from=0.0)
    assert timed_steps(records) == list(range(30))


def planned(step_seconds: float, steps: int) -> list[int]:
    """The steps _plan_marks times, of ``steps`` steps of ``step_seconds`` each."""
    loop = Loop(seed=4)
    probe = tdbg.watch(loop.model, loop.opt, name="gap")
    sampler, hooks = probe._sampler, probe._hooks
    on_a_fake_gpu(probe)
    sampler._step_ema = step_seconds
    timed = []
    for _ in range(steps):
        sampler.step_count += 1
        sampler._plan_marks(hooks)
        assert hooks.host_marks is not sampler._marked
        assert (sampler._mark is fake_cuda_mark) is sampler._marked
        if sampler._marked:
            timed.append(sampler.step_count)
    probe.close()
    return timed


def test_the_gap_follows_the_step_length(runtime_dir: Path) -> None:
    """One step in ceil(threshold / step time) is timed on average: 25 ms steps under the
    100 ms threshold, one in 4, at most 7 apart; steps far shorter, one in MAX_MEAN_GAP, under
    MAX_PHASE_GAP apart; steps of the threshold or longer, every one."""
    assert cost_model.MARK_EVERY_STEP_FROM == 0.1
    for step, mean, longest in ((0.025, 4, 7), (1e-6, cost_model.MAX_MEAN_GAP, 31)):
        timed = planned(step, 4000)
        distances = [b - a for a, b in zip(timed, timed[1:], strict=False)]
        assert max(distances) == longest < MAX_PHASE_GAP
        assert 0.9 * mean < sum(distances) / len(distances) < 1.1 * mean
    assert planned(0.1, 50) == list(range(1, 51))


def test_timed_steps_do_not_fall_on_one_point_of_a_periodic_wait(runtime_dir: Path) -> None:
    """A DataLoader whose workers deliver in lockstep makes one step in W wait long: timed
    steps one in 4 at a fixed period would each land on the same point of a 4-step cycle
    (the wait always, or never). At random distances each point gets its share."""
    timed = planned(0.025, 4000)
    for period in (2, 3, 4, 5, 8):
        shares = [sum(1 for s in timed if s % period == r) / len(timed) for r in range(period)]
        assert all(abs(share - 1 / period) < 0.35 / period for share in shares), (period, shares)


def test_a_gpu_bound_step_costs_what_the_probe_adds_to_the_device(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the device has not finished the step before when the host is done with this one
    (the host runs ahead: GPU-bound), the host's work, the probe's with it, hides behind the
    device's: a step costs what the probe adds to the device (a gradient pass's device time),
    not its host time, and the cost the probe reports says so. Where the device keeps up
    (launch-bound), the host time is the cost, as on the CPU."""
    monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", 0.0)  # every step's end a mark

    def run(busy: bool) -> list[Any]:
        loop = Loop(seed=5)
        probe = tdbg.watch(loop.model, loop.opt, name="bound", grad_every=4)
        on_a_fake_gpu(probe)
        probe._sampler._grad_device_cost = 2e-6  # what its passes took on the device
        sent = handed_over(probe, monkeypatch)
        FakeEvent.busy = busy
        try:
            for _ in range(12):
                loop.step(probe)
        finally:
            FakeEvent.busy = False
        probe.close()
        return [pending.probe_time for pending in sent]

    ahead = run(busy=True)
    # step 0 has no step before it; then the passes' device time, every 4th step, else nothing
    assert ahead[0] > 0
    assert ahead[1:] == [2e-6 if step % 4 == 0 else 0.0 for step in range(1, 12)]
    kept_up = run(busy=False)
    assert all(t > 1e-6 for t in kept_up)  # host time, as timed: microseconds a step


def test_passes_on_gpu_bound_steps_are_not_free_to_the_interval(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hidden host work does not make a gradient pass free: until a pass's device time is
    measured its host time is what the step reports, and the interval always goes by a pass's
    host time (how much room the host has behind the device is not known). Before, the
    interval collapsed to a pass every step, each reported as costing nothing."""
    monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", 0.0)
    loop = Loop(seed=6)
    probe = tdbg.watch(loop.model, loop.opt, name="bound-auto")  # the adaptive interval
    on_a_fake_gpu(probe)
    sent = handed_over(probe, monkeypatch)
    FakeEvent.busy = True  # the device never catches up: every step after the first hidden
    try:
        for _ in range(60):
            loop.step(probe)
        # No pass resolved (its events never done): its device time is not known.
        device_cost = probe._sampler._grad_device_cost
    finally:
        FakeEvent.busy = False
    assert device_cost == 0.0
    passes = [p for p in sent[1:] if p.grads is not None]
    assert passes and all(p.probe_time > 0 for p in passes)  # host time, not "free"
    assert all(p.probe_time == 0.0 for p in sent[1:] if p.grads is None)
    assert len(passes) < 30 and probe.grad_interval > 1
    probe.close()


EVAL_SECONDS = 0.3  # the evaluation's length, slept inside it: a floor, never a timed wait
FETCH_SECONDS = 0.2  # the next batch's fetch after it, slept too


def evaluate(loop: Loop) -> None:
    """A validation pass between two steps, as loops run one: forwards without grad."""
    with torch.no_grad():
        loop.model(loop.x)
        time.sleep(EVAL_SECONDS)
        loop.model(loop.x)


def eval_run(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> list[Any]:
    """Ten steps of a real loop, validated before step 4's forward and (a forward without
    grad after the update, before probe.step()) inside step 7; the records."""
    monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", 0.0)  # every step timed
    loop = Loop(seed=6)
    probe = tdbg.watch(loop.model, loop.opt, name="eval", grad_every=5)
    if gpu:
        on_a_fake_gpu(probe)
    sent = handed_over(probe, monkeypatch)
    for step in range(10):
        if step == 4:
            evaluate(loop)
            time.sleep(FETCH_SECONDS)  # the next batch, fetched after the evaluation
        if step == 6:
            # Another thread's forwards without grad (an actor, an inference server) are not
            # the loop's evaluation.
            actor = threading.Thread(target=evaluate, args=(loop,))
            actor.start()
            actor.join()
        if step == 7:
            loop.model.zero_grad(set_to_none=True)
            loss = loop.loss()
            loss.backward()
            loop.optimizer.step()
            evaluate(loop)
            probe.step(loss)
        else:
            loop.step(probe)
    records = []
    for pending in sent:
        start = pending.timeline.no_grad_start
        assert (start is None) is (pending.step != 4), (pending.step, start)
        if start is not None:  # host clock readings, on a GPU too
            assert type(start) is float and type(pending.timeline.no_grad_end) is float
        resolved = pending.resolve()
        assert resolved is not None
        records.append(resolved[0])
        assert not loop.model._forward_hooks  # its forwards' ends no longer marked
    assert probe.errors == 0
    probe.close()
    return records


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_an_evaluation_between_steps_is_no_grad_time_not_data_wait(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    """Forwards without grad between two steps (validation, a rollout) are timed as their own
    phase, from the first of them to the end of the last; the rest of the gap before the
    step's forward is data (it took them for a wait on the data loader: "input-bound" after
    every evaluation). Forwards without grad after the step's own forward (here after its
    update), or on another thread, are not the step's."""
    records = eval_run(monkeypatch, gpu)
    evaluated = records[4]
    assert evaluated.no_grad_time >= EVAL_SECONDS
    assert FETCH_SECONDS <= evaluated.data_time < EVAL_SECONDS  # the fetch, not the evaluation
    assert evaluated.step_time >= EVAL_SECONDS + FETCH_SECONDS
    for record in records[:4] + records[5:]:
        assert record.no_grad_time == 0.0, record.step
    assert records[8].data_time < EVAL_SECONDS  # step 7's evaluation is no wait of step 8's
    assert records[6].data_time >= EVAL_SECONDS  # the loop waited on the actor: not no-grad


def test_a_model_run_without_grad_every_step_keeps_one_end_hook(runtime_dir: Path) -> None:
    """A loop that runs the watched model without grad in every step (a DQN's target, an
    actor's act before its learn) keeps the one forward hook that marks where those forwards
    end (not one registered and removed each step); the first step without any removes it."""
    loop = Loop(seed=7)
    probe = tdbg.watch(loop.model, loop.opt, name="target", grad_every=5)
    seen = []
    for _ in range(6):
        with torch.no_grad():
            loop.model(loop.x)
        loop.step(probe)
        seen.append(list(loop.model._forward_hooks))
    assert len(seen[0]) == 1 and all(hooks == seen[0] for hooks in seen)
    loop.step(probe)
    assert not loop.model._forward_hooks
    assert probe.errors == 0
    probe.close()


def test_an_evaluation_of_a_copy_is_marked_by_the_loop(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evaluating another module (an EMA copy: its hooks are inert) is marked by the loop with
    note_evaluation() / note_evaluation_end(); what follows is data."""
    import copy

    loop = Loop(seed=8)
    probe = tdbg.watch(loop.model, loop.opt, name="ema", grad_every=5)
    sent = handed_over(probe, monkeypatch)
    ema = copy.deepcopy(loop.model)
    for step in range(4):
        if step == 2:
            probe.note_evaluation()
            with torch.no_grad():
                ema(loop.x)
            time.sleep(EVAL_SECONDS)
            probe.note_evaluation_end()
            time.sleep(FETCH_SECONDS)
        loop.step(probe)
    records = [pending.resolve()[0] for pending in sent]
    assert records[2].no_grad_time >= EVAL_SECONDS
    assert FETCH_SECONDS <= records[2].data_time < EVAL_SECONDS
    assert [r.no_grad_time for r in records[:2] + records[3:]] == [0.0] * 3
    probe.close()


@pytest.mark.parametrize("extras", [True, False], ids=["ratios and histograms", "the pass alone"])
def test_a_sampled_step_s_device_time_counts_all_the_probe_s_kernels(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, extras: bool
) -> None:
    """What a GPU-bound step costs is the probe's device time: the gradient pass, and where
    they run the weight copy and histograms right after it and the update ratios'
    measurement after the update (a span of its own, the optimizer's kernels between are not
    the probe's). Before, only the pass was timed: an H200's cnn at batch 8192 cost +0.57 %
    where the probe reported 0.09 %."""
    monkeypatch.setattr(UpdateRatios, "due", lambda self, seconds: extras)
    monkeypatch.setattr(LayerHistograms, "due", lambda self, seconds: extras)
    loop = Loop(seed=7)
    probe = tdbg.watch(loop.model, loop.opt, name="kernels", grad_every=1)
    on_a_fake_gpu(probe)
    sent = handed_over(probe, monkeypatch)
    for _ in range(6):
        loop.step(probe)
    probe.close()
    for pending in sent[1:]:
        marks = pending.grad_marks
        assert marks is not None and len(marks) == (4 if extras else 2)
        assert all(type(m) is CudaMark for m in marks)
        assert marks[0].host <= marks[1].host  # the pass (and what followed it)
        if extras:
            # The ratios' span is after the update, apart from the pass's.
            assert marks[1].host <= marks[2].host <= marks[3].host
            assert pending.update_layers and pending.histograms is not None
        resolved = pending.resolve() or pending.resolve()
        assert resolved is not None
        spans = [marks[k + 1].event.at - marks[k].event.at for k in range(0, len(marks), 2)]
        assert pending.grad_device_time == pytest.approx(sum(spans), rel=1e-6, abs=1e-9)
