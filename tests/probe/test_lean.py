"""Lean steps hand over what the whole way would: the same records, settled exactly when not."""

from __future__ import annotations

import math
import queue
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import handed_over
from test_loss_ring import as_on_a_gpu
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from waiting import TIMEOUT

import tdbg
from tdbg.probe.training import cost_model, loss_ring
from tdbg.probe.training import hooks as hooks_module
from tdbg.probe.training import lean as lean_switch
from tdbg.probe.training import sampler as sampler_module
from tdbg.protocol.steps import MAX_LR_COLUMNS

STEPS = 24


class Plan:
    """What a loop does beyond the ordinary: ``at(step)`` the oddities of that step (by name:
    see _loop), ``modes`` those of the whole run, ``grad_every`` its gradient passes."""

    def __init__(
        self,
        at: Callable[[int], set[str]] = lambda step: set(),
        modes: frozenset[str] = frozenset(),
        grad_every: int = 10**9,
        steps: int = STEPS,
    ) -> None:
        self.at, self.modes, self.grad_every, self.steps = at, modes, grad_every, steps


def _every(name: str, period: int = 1, phase: int = 0) -> Callable[[int], set[str]]:
    return lambda step: {name} if step % period == phase else set()


PLANS = {
    "plain": Plan(),
    "detached": Plan(_every("detached")),
    "number": Plan(_every("number")),
    "none": Plan(_every("none")),
    "eval": Plan(_every("eval", 5, 2)),
    "accumulation": Plan(_every("accumulation", 4, 1)),
    "stray": Plan(_every("stray", 6, 3)),
    "clip": Plan(_every("clip", 3, 0)),
    "closure": Plan(_every("closure", 5, 4)),
    "nan": Plan(lambda step: {"nan"} if step == 9 else set()),
    "other": Plan(_every("other", 4, 2)),
    "loader-thread": Plan(_every("loader-thread", 7, 3)),
    "add": Plan(lambda step: {"add"} if step == 8 else set()),
    "post-hook": Plan(modes=frozenset({"post-hook"})),
    "clip-in-update": Plan(_every("clip-in-update", 3, 1), frozenset({"clip-in-update"})),
    "passes": Plan(grad_every=4),
    "twice": Plan(_every("twice", 5, 3)),
    "closure-none": Plan(_every("closure-none")),
}
VARIANTS = list(PLANS)


def _mixed(seed: int) -> Plan:
    """A loop whose oddities come at random steps, several in one step and one after another
    (the variants above each keep to one kind): what a real script's mix looks like."""
    rng = random.Random(seed)
    modes = {mode for mode in ("post-hook", "clip-in-update") if rng.random() < 0.25}
    grad_every = rng.choice([3, 7, 10**9])
    steps = 40
    add_at = rng.randrange(3, steps) if rng.random() < 0.3 else -1
    plan: list[set[str]] = []
    for step in range(steps):
        now = {name for name, p in ODDS if rng.random() < p}
        if "post-hook" in modes:
            now -= {"twice", "detached", "number", "other"}  # probe.step() is the hook's
        else:
            now.add(
                rng.choices(["loss", "detached", "number", "none", "other"], [4, 2, 1, 2, 1])[0]
            )
        now.add(rng.choices(["step", "closure", "closure-none", "twice"], [7, 1, 1, 1])[0])
        if step == add_at:
            now.add("add")
        if "twice" in now and "post-hook" in modes:
            now.discard("twice")
        plan.append(now)
    return Plan(lambda step: plan[step], frozenset(modes), grad_every, steps)


# Each step's chance of each oddity in a mixed loop.
ODDS = (
    ("eval", 0.1),
    ("accumulation", 0.15),
    ("stray", 0.05),
    ("clip", 0.15),
    ("clip-in-update", 0.15),  # (only where that mode registered its hook)
    ("nan", 0.03),
    ("loader-thread", 0.03),
    ("schedule-after", 0.15),
)


def _loop(plan: Plan, device: bool = False) -> Callable[[Any], list[Any]]:
    """A real loop of ``plan.steps`` steps, ordinary except where ``plan`` makes some steps not
    lean: it returns what the probe handed its thread. ``device``: the probe as on a GPU run
    (test_loss_ring.as_on_a_gpu: its losses kept unread in a loss ring, its phases timed on
    one step in a few)."""

    def run(monkeypatch: Any) -> list[Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        second = nn.Linear(4, 1)
        second_opt = torch.optim.SGD(second.parameters(), lr=0.01)
        added = False
        # The loop's dataset, made once (a new one at each pass could take a freed one's id).
        data = torch.utils.data.TensorDataset(torch.arange(4.0))
        probe = tdbg.watch(model, opt, name="lean", grad_every=plan.grad_every)
        if device:
            as_on_a_gpu(probe, monkeypatch)
            # One step in MAX_MEAN_GAP timed, whatever the steps' length: both ways time the
            # same steps (the distances come from the probe's own seeded generator).
            monkeypatch.setattr(cost_model, "MARK_EVERY_STEP_FROM", 1e9)
        sent = handed_over(probe, monkeypatch)
        if "post-hook" in plan.modes:
            # probe.step() from a post-hook registered after the probe's (tdbg run's way): in
            # the middle of torch's loop over the post-hooks, which nothing may change.
            opt.register_step_post_hook(lambda *_: probe.step())
        if "clip-in-update" in plan.modes:
            # A pre-hook after the probe's that clips on some steps: inside the update, once
            # its end is to be stamped (update_stamp), the record is settled.
            def clip_some(*_: Any) -> None:
                if "clip-in-update" in now:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

            opt.register_step_pre_hook(clip_some)
        try:
            for step in range(plan.steps):
                now = plan.at(step)
                if "eval" in now:
                    with torch.no_grad():
                        model(x)  # an evaluation between the steps
                opt.zero_grad()
                micro = 3 if "accumulation" in now else 1
                for _ in range(micro):
                    loss = ((model(x) - y) ** 2).mean() / micro
                    if "nan" in now:
                        loss = loss * float("nan")
                    loss.backward()
                if "stray" in now:
                    aside = (torch.randn(3, requires_grad=True) ** 2).sum()
                    aside.backward()  # a backward of no watched forward
                if "loader-thread" in now:
                    # A DataLoader's new pass, begun on another thread mid-step: the tap's event
                    # does not settle the training thread's record from there; probe.step()
                    # sees the pass and takes the step the whole way.
                    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(data)
                    reader = threading.Thread(target=list, args=(loader,))
                    reader.start()
                    reader.join()
                if "add" in now:
                    # A second model and optimizer watched from inside a lean step (tdbg run
                    # adds a GAN's second pair from an optimizer's pre-hook): the step so far
                    # is settled with the layers it ran on.
                    probe.add(second, second_opt)
                    added = True
                if "clip" in now:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                if "closure" in now:

                    def closure() -> torch.Tensor:
                        opt.zero_grad()
                        again = ((model(x) - y) ** 2).mean()
                        again.backward()
                        return again

                    opt.step(closure)
                elif "closure-none" in now:
                    opt.step(None)  # accelerate's way: no closure, passed by position
                else:
                    if "twice" in now:
                        # Two updates in one step: the second's pre-hook, out of its dict while
                        # the step was lean, is put back by the optimizer tap to run.
                        opt.step()
                    opt.step()
                if added:
                    second_opt.zero_grad()
                    second(x).pow(2).mean().backward()
                    second_opt.step()
                if "schedule-after" not in now:
                    schedule.step()
                if "detached" in now:
                    probe.step(loss.detach(), samples=16)
                elif "number" in now:
                    probe.step(loss.item(), tokens=64)
                elif "none" in now:
                    probe.step()
                elif "post-hook" in plan.modes:
                    pass  # stepped by the post-hook
                elif "other" in now:
                    # Not the scalar backpropagated: settled at probe.step(), all four readings.
                    probe.step(loss * 2.0)
                else:
                    probe.step(loss)
                if "schedule-after" in now:
                    schedule.step()  # after probe.step(): the next update's rate
                if "nan" in now:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.nan_to_num_(0.0)
        finally:
            probe.close()
        assert probe.errors == 0, probe.last_error
        return sent

    return run


def _seen(sent: list[Any], device: bool = False) -> list[tuple[Any, ...]]:
    """What users see of each step handed over, less the clock's readings: which phases were
    marked stands in for their times (``device``: which were timed, a GPU step's phases being
    timed on one step in a few and the others' marks not read)."""

    def number(value: Any) -> Any:
        value = float(value) if value is not None else math.nan
        return "nan" if math.isnan(value) else round(value, 9)

    seen = []
    for s in sent:
        resolved = s.resolve() or s.resolve()  # (a loss ring's first read starts its copy)
        assert resolved is not None
        record, _ = resolved
        tl = s.timeline
        if device:
            marks = tuple(
                getattr(record, name) == getattr(record, name)
                for name in ("data_time", "forward_time", "backward_time", "optimizer_time")
            )
        else:
            marks = tuple(
                getattr(tl, name) is not None
                for name in ("forward_start", "forward_end", "optimizer_start", "optimizer_end")
            ) + (tl.no_grad_start is not None,)
        seen.append(
            (
                record.step,
                number(record.loss),
                tuple(record.lr),
                number(record.micro_batches),
                number(record.samples),
                number(record.tokens),
                number(record.clip_norm),
                number(record.epoch),
                record.grad_norms is not None,
                marks,
                record.step_time == record.step_time,
                record.probe_time > 0,
            )
        )
    return seen


def lean_steps_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps handed over lean from now on (each one's count before it), as a list."""
    taken: list[int] = []
    hand_lean = sampler_module.StepSampler._hand_lean_gpu_step
    hand_fast = sampler_module.StepSampler.hand_lean_cpu_step

    def counted(self: Any, *args: Any) -> None:
        taken.append(self.step_count)
        hand_lean(self, *args)

    def counted_fast(self: Any, *args: Any) -> bool:
        count = self.step_count
        handed = hand_fast(self, *args)
        if handed:  # a CPU run's (straight from probe.step() or through StepSampler.step)
            taken.append(count)
        return handed

    monkeypatch.setattr(sampler_module.StepSampler, "_hand_lean_gpu_step", counted)
    monkeypatch.setattr(sampler_module.StepSampler, "hand_lean_cpu_step", counted_fast)
    return taken


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("pre_out", [True, False], ids=["pre-hook out", "pre-hook in place"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_lean_steps_hand_over_what_the_whole_way_does(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, variant: str, pre_out: bool, device: bool
) -> None:
    # The same loop with lean steps and without (every step's bookkeeping the whole way): the
    # same losses, learning rates of the updates, micro-batches, counts, clips, gradient
    # passes and marked phases. Steps that are not lean (an accumulation, a clip, a closure,
    # an evaluation's forward, a stray backward, a NaN) settle what the lean hooks had read
    # and go on the whole way, as if the step had never been lean. Either way of starting a
    # lean update: the optimizer tap with the step pre-hook out of its dict, or the hook.
    monkeypatch.setattr(hooks_module, "PRE_OUT", pre_out)
    taken = lean_steps_counted(monkeypatch)
    run = _loop(PLANS[variant], device)
    with monkeypatch.context() as whole:
        whole.setattr(lean_switch, "ENABLED", False)
        without = _seen(run(whole), device)
    assert not taken
    with_lean = _seen(run(monkeypatch), device)
    assert with_lean == without
    assert len(with_lean) == STEPS
    # Lean steps there were: all but the first (a gradient pass) where every step is usual,
    # some where the variant breaks the pattern on some steps.
    if device:
        # On a GPU run not the ones whose phases are timed.
        assert taken and len(taken) < STEPS - 1
    elif variant in ("plain", "detached", "number", "none", "post-hook", "closure-none"):
        assert taken == list(range(1, STEPS))
    else:
        assert 0 < len(taken) < STEPS - 1


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("seed", range(16))
def test_a_mixed_loop_hands_over_what_the_whole_way_does(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, seed: int, device: bool
) -> None:
    # Oddities at random steps, several in a step and back to back (an evaluation, then a
    # NaN in an accumulated step with a clip and a closure, a scheduler stepped after
    # probe.step(), a second model added mid-run): a lean step settled by one of them, the
    # next armed again or not, each step's records the whole way's.
    monkeypatch.setattr(hooks_module, "PRE_OUT", seed % 2 == 0)
    if device and seed % 2:
        # A ring of a few slots: full before the probe thread reads it back, its steps then
        # copied at their step, its slots written again after the wrap.
        monkeypatch.setattr(loss_ring, "CAPACITY", 6)
    plan = _mixed(seed)
    taken = lean_steps_counted(monkeypatch)
    run = _loop(plan, device)
    with monkeypatch.context() as whole:
        whole.setattr(lean_switch, "ENABLED", False)
        without = _seen(run(whole), device)
    assert not taken
    with_lean = _seen(run(monkeypatch), device)
    assert len(with_lean) == plan.steps
    for step, (lean_way, whole_way) in enumerate(zip(with_lean, without, strict=True)):
        assert lean_way == whole_way, (step, sorted(plan.at(step)), plan.modes)
    if not device and not any("add" in plan.at(step) for step in range(plan.steps)):
        # (Never with a second optimizer; on a GPU run not on its first or timed steps.)
        assert taken


def test_a_lean_step_s_phases_are_timed_in_order(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lean step's readings are the marks of its phases: forward, backward and optimizer
    # times, each positive, and the step's time from start to start.
    sent = _loop(PLANS["plain"])(monkeypatch)
    for s in sent[2:]:
        record, _ = s.resolve()
        phases = (record.forward_time, record.backward_time, record.optimizer_time)
        assert all(p > 0 for p in phases), phases
        assert record.step_time > sum(phases)


def test_a_failed_lean_backward_is_taken_back(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loop that skips a batch whose backward raised (out of memory) goes on: that scalar was
    # not backpropagated, on a lean step as on any.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    probe = tdbg.watch(model, opt, name="failed", grad_every=10**9)
    sent = handed_over(probe, monkeypatch)

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
            return value.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("out of memory (made up)")

    try:
        for step in range(6):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if step == 3:
                assert probe._sampler.lean.on
                with pytest.raises(RuntimeError, match="made up"):
                    Fails.apply(loss).backward()
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            probe.step()
    finally:
        probe.close()
    assert probe.errors == 0, probe.last_error
    records = [s.resolve()[0] for s in sent]
    assert [r.micro_batches for r in records] == [1.0] * 6
    assert all(r.loss == r.loss and r.loss > 0 for r in records)


Body = Callable[[int, nn.Module, torch.optim.Optimizer, Any], None]


def both_ways(
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    body: Body,
    make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]] | None = None,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[int]]:
    """``steps`` steps of ``body(step, model, optimizer, probe)`` (the model and optimizer
    ``make()``'s, by default a small MLP with SGD), run the whole way and then with lean
    steps: what each way handed over (_seen), and the steps handed over lean."""
    taken = lean_steps_counted(monkeypatch)
    seen = []
    for lean_on in (False, True):
        with monkeypatch.context() as way:
            way.setattr(lean_switch, "ENABLED", lean_on)
            torch.manual_seed(0)
            if make is None:
                model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
                opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            else:
                model, opt = make()
            probe = tdbg.watch(model, opt, name="ways", grad_every=10**9)
            sent = handed_over(probe, way)
            try:
                for step in range(steps):
                    body(step, model, opt, probe)
            finally:
                probe.close()
            assert probe.errors == 0, probe.last_error
            seen.append(_seen(sent))
        if not lean_on:
            assert not taken
    return seen[0], seen[1], taken


X, Y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.ones(16, 1)


def test_another_thread_s_forward_without_grad_leaves_the_loop_s_step_as_it_is(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor's (or an evaluation server's) forward without grad of the watched model on
    another thread, run while the loop's backward tap reads the loss (``.item()`` lets the
    GIL go): not the loop's, it settles nothing (settled from there, the tap's write after it
    lost the step's loss and micro-batch, and the next step showed both steps' losses)."""
    fired: list[int] = []

    def body(step: int, model: nn.Module, opt: torch.optim.Optimizer, probe: Any) -> None:
        def actor() -> None:
            with torch.no_grad():
                model(torch.randn(2, 4))

        def in_the_tap(frame: Any, event: str, arg: Any) -> None:
            if (
                event == "c_call"
                and getattr(arg, "__name__", "") == "item"
                and frame.f_code.co_name == "backward"
                and step == 3
            ):
                fired.append(step)
                thread = threading.Thread(target=actor)
                thread.start()
                thread.join()

        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        sys.setprofile(in_the_tap)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
        opt.step()
        probe.step()

    whole, lean_way, taken = both_ways(monkeypatch, 6, body)
    assert fired == [3, 3]  # once each way
    assert lean_way == whole
    assert 3 in taken  # the step stayed lean


def test_a_clip_on_the_loop_s_thread_reaches_a_probe_step_on_another(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop on a worker thread, ``probe.step()`` on the main one after each update (a
    queue to the thread that logs): each step's clip is recorded, as the whole way does (the
    lean hand-over left it behind: no clip recorded, and no later one either)."""
    go: queue.Queue[None] = queue.Queue()
    done: queue.Queue[torch.Tensor] = queue.Queue()

    def body(step: int, model: nn.Module, opt: torch.optim.Optimizer, probe: Any) -> None:
        if step == 0:

            def worker() -> None:
                for _ in range(8):
                    go.get()
                    opt.zero_grad()
                    loss = ((model(X) - Y) ** 2).mean()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                    opt.step()
                    done.put(loss)

            threading.Thread(target=worker, daemon=True).start()
        go.put(None)
        probe.step(done.get(timeout=TIMEOUT))

    whole, lean_way, _ = both_ways(monkeypatch, 8, body)
    assert lean_way == whole
    assert all(clip != "nan" for _, _, _, _, _, _, clip, *_ in whole)


def test_a_learning_rate_hook_registered_in_place_of_another_is_read_after(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process-wide optimizer pre-hook that sets the learning rate, registered mid-run as
    another (registered before the probe) is removed: the update's rate is the one it set
    (the hooks counted as many as before, the lean read came before it: one update late)."""
    handles: list[Any] = []

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        while handles:  # the way before's
            handles.pop().remove()
        handles.append(register_optimizer_step_pre_hook(lambda *_: None))
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def body(step: int, model: nn.Module, opt: torch.optim.Optimizer, probe: Any) -> None:
        if step == 4:
            handles.pop().remove()

            def warm_up(optimizer: Any, args: Any, kwargs: Any) -> None:
                for group in optimizer.param_groups:
                    group["lr"] = 0.001 * (step_now[0] + 1)

            handles.append(register_optimizer_step_pre_hook(warm_up))
        step_now[0] = step
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)

    step_now = [0]
    try:
        whole, lean_way, _ = both_ways(monkeypatch, 10, body, make)
    finally:
        for handle in handles:
            handle.remove()
    assert [lrs for _, _, lrs, *_ in whole][4:] == [(0.001 * (k + 1),) for k in range(4, 10)]
    assert lean_way == whole


def test_more_param_groups_than_a_step_carries_are_recorded_as_the_whole_way_does(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optimizer of more than MAX_LR_COLUMNS param groups (a group per parameter, as
    layer-wise learning-rate decay makes): its steps go the whole way, which records the
    first rates and says so once (handed over lean, every rate, no step could be sent: all
    were lost, and the probe switched itself off)."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(33)])  # 66 parameters
        groups = [{"params": [p], "lr": 0.01} for p in model.parameters()]
        return model, torch.optim.SGD(groups)

    def body(step: int, model: nn.Module, opt: torch.optim.Optimizer, probe: Any) -> None:
        opt.zero_grad()
        loss = model(X).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss)

    whole, lean_way, taken = both_ways(monkeypatch, 12, body, make)
    assert lean_way == whole and not taken
    assert {len(lrs) for _, _, lrs, *_ in whole} == {MAX_LR_COLUMNS}
