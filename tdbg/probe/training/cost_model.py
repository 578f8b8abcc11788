"""What the probe costs the loop, step by step, and the gradient interval keeping it in budget."""

from __future__ import annotations

import math
from collections.abc import Iterable

from tdbg.probe.training import budget
from tdbg.probe.training.budget import gradient_interval
from tdbg.probe.training.gradients import GradSample
from tdbg.probe.training.hooks import PhaseHooks, perf
from tdbg.probe.training.sampler_state import NAN, SamplerState
from tdbg.protocol.steps import MAX_PHASE_GAP

EMA = 0.1  # weight of the newest value in the running averages of step time and costs
# Weight of the newest step in the probe's spent fraction (its time over the step's): ~100
# steps' memory, like the 200-step window of the cost_fraction it reports.
SPENT_EMA = 0.01
# A GPU run's steps at least this long (seconds) each have their phases timed with CUDA events;
# shorter ones one step in ceil(this / step) on average (at most MAX_MEAN_GAP), at random
# distances under MAX_PHASE_GAP. The 5 events a timed step records cost ~150 us of host time
# on an H200 (each ~20-35 us: benchmarks/gpu_parts.py), so timing costs at most ~0.15 % of
# any step's time; at 20 ms (before 2026-11-29) it cost up to 0.75 %.
MARK_EVERY_STEP_FROM = 0.1
# The mean distance between timed steps is at most this: random distances up to twice it
# less one stay within MAX_PHASE_GAP.
MAX_MEAN_GAP = MAX_PHASE_GAP // 2
# The running averages of the first this many steps are kept on the training thread, at each
# step (the interval has something to go by from the second step, not from the probe thread's
# first tick, up to 100 ms of passes on every step later); every later step's on the probe
# thread, in bulk at its ticks (fold_costs), in step order: probe.step()'s usual step
# then only hands its clock readings over.
COUNTED_HERE = 16


class CostModel(SamplerState):
    """Running averages of the step, the fixed work and a gradient pass; the interval from them."""

    __slots__ = ()

    def _account(
        self,
        t0: float,
        hooks: PhaseHooks,
        step_time: float,
        sample: GradSample | None,
        hidden: bool,
        micro: int,
    ) -> float:
        """Count the step just handed over: what the probe cost it (returned: its probe_time),
        the running averages the gradient interval goes by, and whether the next step samples.
        ``t0``: when probe.step() began; ``hidden``: a GPU-bound step whose host work the
        device hides; ``micro``: its micro-batches."""
        self._pass_batches += micro or 1
        self.step_count += 1
        # The gradient pass is counted once: in this call or in the hook that ran it. The taps'
        # time (backward, optimizer steps) is the probe's cost too.
        hook_seconds, hooks.seconds = hooks.seconds, 0.0
        tap_seconds = self._tap_seconds  # taps.take_seconds(), written out
        timed = (perf() - t0) + hook_seconds + tap_seconds[0]
        tap_seconds[0] = 0.0
        # What the fixed work (the hooks' and this call's few lines) costs the loop, not only
        # what the probe timed of it: torch's calls into the hooks and their cold entry,
        # outside any timer (budget.FIXED_UNTIMED), and the probe thread's per-step work
        # (budget.FIXED_PER_STEP). Work timed whole is counted as timed.
        # budget.probe_seconds written out (on a GPU run every step comes here, and a call on
        # the training thread costs microseconds cold; tests/probe/test_budget.py holds the two
        # equal). A conditional, not max(): a builtin's first call here costs microseconds.
        untimed = timed - self._grad_seconds
        per_step = budget.FIXED_PER_STEP
        fixed = untimed * budget.FIXED_SCALE + per_step if untimed > 0.0 else per_step
        probe_time = host_time = self._grad_seconds + fixed
        if hidden and (sample is None or self._grad_device_cost > 0.0):
            # A GPU-bound step: the host's work costs the step nothing (the device sets its
            # pace); what the probe adds is its kernels' device time, a gradient pass's (as
            # measured of the recent ones: until one is, its host time counts). Measured on an
            # H200 at batch 8192: +0.03-0.15 % where the host times read 2.6-4.6 %
            # (benchmarks/README.md).
            probe_time = self._grad_device_cost if sample is not None else 0.0
        self._grad_seconds = 0.0
        # The interval's model of the cost: what every step pays (the running average over
        # steps without a gradient pass, kept by fold_costs after the first steps) plus, every
        # k steps, what a step with one pays on top of that: the pass and all that comes with
        # it (its staging, its share of the fixed work, the weights where a NaN was found), so
        # that the model's cost is the one the probe reports. (The pass's own time alone left
        # out the rest: 1.2-1.3 % measured for a 1 % budget on the cnn demo's paced steps.)
        if sample is not None and not self._replanned:
            # A pass's host time, hidden or not: how much room the host has left behind the
            # device is not known, and passes as often as their device time alone allows could
            # make the host the bottleneck (then its work counts again, and the interval would
            # swing between the two).
            surplus = max(0.0, host_time - self._fixed_cost)
            cost = self._grad_cost
            self._grad_cost = surplus if cost == 0.0 else (1 - EMA) * cost + EMA * surplus
        self._replanned = False
        if sample is not None:
            self._last_sampled = self.step_count - 1
        if self.step_count <= COUNTED_HERE:
            self._fold(((self.step_count - 1, probe_time, step_time, sample is not None),))
        since = self.step_count - self._last_sampled
        if self.grad_every is not None:
            self.grad_interval = self.grad_every
        elif since >= self.grad_interval or sample is not None or self.step_count % 8 == 0:
            self._replan()
        self._sample_now = since >= self.grad_interval
        return probe_time

    def fold_costs(self, costs: list[tuple[int, float, float, bool]]) -> None:
        """From the probe thread, once a tick: count the steps it resolved into the running
        averages the interval goes by, in step order, each (step, probe time, step time,
        whether it carried a gradient pass); not the first COUNTED_HERE, which the training
        thread counted as they ended (their averages stored before any later step was handed
        over: the two threads never write them at once); then the interval from them."""
        if costs and costs[0][0] < COUNTED_HERE:
            costs = [cost for cost in costs if cost[0] >= COUNTED_HERE]
        if costs:
            self._fold(costs)
            if self.grad_every is None:
                # The interval from the averages just stored (the training thread works it out
                # again after a pass and when one is due: either's is from stored averages).
                self._replan()

    def _fold_here(
        self,
        step: int,
        t0: float,
        last_host: float | None,
        end: float,
        hook_seconds: float,
        whole: float,
        scale: float = budget.FIXED_SCALE,
    ) -> None:
        """One of the first COUNTED_HERE steps, on the training thread, from the readings its
        short way hands over (the probe thread works out the same: pending.usual_record);
        ``scale``: its fixed work's (budget.probe_seconds)."""
        step_time = NAN if last_host is None else t0 - last_host
        probe_time = budget.probe_seconds((end - t0) + hook_seconds, whole, scale)
        self._fold(((step, probe_time, step_time, False),))

    def _fold(self, costs: Iterable[tuple[int, float, float, bool]]) -> None:
        """Count ``costs`` (see :meth:`fold_costs`) into the running averages: worked in locals
        and stored at the end, so a reader never sees one step half-counted."""
        fixed, step, spent_probe, spent_step = (
            self._fixed_cost,
            self._step_ema,
            self._spent_probe,
            self._spent_step,
        )
        last = self._costs_through
        for number, probe_time, step_time, sampled in costs:
            last = number
            if not sampled:
                # What every step pays: the running average over steps without a pass.
                fixed = probe_time if fixed == 0.0 else (1 - EMA) * fixed + EMA * probe_time
            if step_time == step_time and step_time > 0:
                step = step_time if step == 0.0 else (1 - EMA) * step + EMA * step_time
                # Every step's whole probe time, the gradient passes and what each step pays,
                # against the step's: the cost the budget is about, as the probe reports it.
                spent_probe = (1 - SPENT_EMA) * spent_probe + SPENT_EMA * probe_time
                spent_step = (1 - SPENT_EMA) * spent_step + SPENT_EMA * step_time
        self._fixed_cost, self._step_ema = fixed, step
        self._spent_probe, self._spent_step = spent_probe, spent_step
        self._costs_through = last

    def _replan(self) -> None:
        """Work the gradient interval out again from the running averages."""
        step, grad, fixed_cost, spent = self.measured_costs()
        self.grad_interval = gradient_interval(step, grad, fixed_cost, self.overhead_budget, spent)

    def _plan_marks(self, hooks: PhaseHooks) -> None:
        """Whether the next step of a GPU run has its phases timed (CUDA events) or marked
        with the host clock only (its phase columns NaN): every step when steps take
        MARK_EVERY_STEP_FROM or more (or are not known yet), else one in ``gap`` on average,
        ``gap`` = ceil(MARK_EVERY_STEP_FROM / step) <= MAX_MEAN_GAP, each distance drawn
        uniformly from 1 .. 2 * gap - 1."""
        step = self._step_ema
        gap = 1
        if 0.0 < step < MARK_EVERY_STEP_FROM:
            gap = min(MAX_MEAN_GAP, math.ceil(MARK_EVERY_STEP_FROM / step))
        marked = self.step_count >= self._next_marked or gap == 1
        if marked:
            self._next_marked = self.step_count + 1 + int(self._mark_rng.random() * (2 * gap - 1))
        self.use_marks(hooks, marked)

    def use_marks(self, hooks: PhaseHooks, timed: bool) -> None:
        """Mark the next step of a GPU run with CUDA events (``timed``: its phases timed) or
        with the host clock alone, the sampler and ``hooks`` alike."""
        self._marked = timed
        self._mark = self._cuda_mark if timed else perf
        hooks.host_marks = not timed

    def on_grad_device_time(self, seconds: float) -> None:
        """From the probe thread: a resolved gradient pass's device time (one float store)."""
        if seconds == seconds and seconds > 0:
            cost = self._grad_device_cost
            self._grad_device_cost = seconds if cost == 0.0 else (1 - EMA) * cost + EMA * seconds

    def measured_costs(self) -> tuple[float, float, float, float]:
        """What the adaptive interval goes by (running averages, seconds): a step; what a step
        with a gradient pass costs the loop on top of one without (or the pass's device time,
        where larger); the probe's cost on a step without one; and the fraction of step time
        the probe spent over its recent steps (NaN until known)."""
        spent = self._spent_probe / self._spent_step if self._spent_step > 0 else NAN
        grad = max(self._grad_cost, self._grad_device_cost)
        return self._step_ema, grad, self._fixed_cost, spent
