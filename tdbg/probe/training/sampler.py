"""The probe's per-step work on the training thread: loss, LR, the gradient pass, its cost."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tdbg.probe.training import lean as lean_switch
from tdbg.probe.training import taps
from tdbg.probe.training.budget import LEAN_SCALE
from tdbg.probe.training.cost_model import COUNTED_HERE, EMA, CostModel
from tdbg.probe.training.epochs import EpochCounter
from tdbg.probe.training.grad_passes import GradientPasses
from tdbg.probe.training.gradients import Layer
from tdbg.probe.training.histograms import HistogramPart
from tdbg.probe.training.hooks import CudaMark, Mark, PhaseHooks, StepTimeline, perf
from tdbg.probe.training.inbox import Inbox
from tdbg.probe.training.loss_ring import copied_now
from tdbg.probe.training.loss_tally import LossTally
from tdbg.probe.training.pending import PendingStep
from tdbg.probe.training.release import HELD
from tdbg.probe.training.sampler_state import NAN
from tdbg.probe.training.self_timing import TIMED, TIMED_EVERY
from tdbg.probe.training.step_values import (
    MAX_COUNT,
    PLAIN_COUNTS,
    StepValues,
    _Tensor,
    host_nonfinite,
    stage_values,
)
from tdbg.protocol.steps import MAX_LR_COLUMNS


class StepSampler(LossTally, GradientPasses, EpochCounter, CostModel, StepValues):
    """Everything ``probe.step()`` and the hooks do on the training thread.

    Per step: the loss (never read from the device here), the learning rates, the step's
    timeline, and — every ``grad_interval`` steps, chosen to stay within ``overhead_budget``
    unless ``grad_every`` fixes it — one fused gradient pass per optimizer, on the gradients its
    update uses (before any clipping); the step goes to the probe thread's inbox with its one
    device-to-host copy in flight. O(1) Python, no sync.

    It also listens to the process-wide taps (:mod:`tdbg.probe.training.taps`): the scalars
    backpropagated since the last update (summed: gradient accumulation; the first inside a
    ``step(closure)``), GradScaler's skipped updates, clips, a DataLoader's passes.

    The parts, one job each: :class:`LossTally` (what was backpropagated for the update),
    :class:`GradientPasses` (when the gradient pass runs and over what), :class:`EpochCounter`,
    :class:`CostModel` (what the probe costs, the interval) and :class:`StepValues` (reading
    what the loop passes); their state is :class:`SamplerState`'s slots. Here: the step itself,
    a lean one from its record (:meth:`hand_lean_cpu_step`, :meth:`_hand_lean_gpu_step`,
    lean.py), another usual one by its own short path, any other the whole way.
    """

    __slots__ = ()

    def __init__(
        self,
        layers: list[Layer],
        optimizers: list[tuple[str, torch.optim.Optimizer]],
        cuda_device: torch.device | None,
        handoff: Inbox,
        *,
        grad_every: int | None,
        overhead_budget: float,
        count_error: Callable[[BaseException], None],
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__(
            layers,
            optimizers,
            cuda_device,
            handoff,
            grad_every=grad_every,
            overhead_budget=overhead_budget,
            count_error=count_error,
            skip_nonfinite=skip_nonfinite,
        )
        self.rebuild(layers, [(i, name, opt) for i, (name, opt) in enumerate(optimizers)])

    @property
    def optimizer_names(self) -> list[str]:
        return [slot.name for slot in self._slots]

    # --- what changes the watched layers (taps.Listener) -----------------------------------------
    def on_module_change(self, module: Any) -> None:
        if id(module) in self.watched_modules:
            self.layout_dirty = True  # handled at the next probe.step(), a step boundary

    def on_any_optimizer_step(self, optimizer: Any) -> None:
        seen = self._checked.get(id(optimizer))
        if seen is not None and seen() is optimizer:
            return  # one dict lookup per step of an optimizer seen before
        self._checked = {k: r for k, r in self._checked.items() if r() is not None}
        self._checked[id(optimizer)] = weakref.ref(optimizer)
        if any(slot.optimizer is optimizer for slot in self._slots):
            return
        if self.optimizer_seen is not None:
            self.optimizer_seen(optimizer)
        held = (id(p) for g in optimizer.param_groups for p in g["params"])
        if any(i in self.watched_params for i in held):
            # A new optimizer updates the watched model (it replaced the one given to watch()).
            self.new_optimizers.append(weakref.ref(optimizer))
            self.layout_dirty = True
        elif self.layout_dirty:
            # The watched layers changed and are re-read at this step's end: an optimizer of
            # only the new ones (a new head's, the backbone frozen) is asked again then.
            self.unplaced_optimizers.append(weakref.ref(optimizer))

    def step(self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float) -> None:
        """One ``probe.step()``: hand the step to the probe thread, sample gradients if due.
        ``t0``: when the caller's ``probe.step()`` began (its clock: ``perf``), the start of
        the probe's cost and of the step's time.

        A lean step (lean.py: its hooks wrote only their readings) is handed over from its
        record (:meth:`hand_lean_cpu_step`, which Probe.step calls first in the steady state;
        :meth:`_hand_lean_gpu_step`), or settled first when it turns out not to be one.

        Any other usual step of a CPU run is handed over here, in this one frame, as its values: one
        optimizer updated once, no gradient pass due or forced, nothing rare to hand on, its
        loss known as a number, past the first COUNTED_HERE steps; the probe thread builds the
        step from them (pending.usual_record) and counts its costs (CostModel.fold_costs): here
        the clock is read and the readings stored. Each Python function entered and each object
        touched here, right after the update, costs microseconds (the loop's kernels have
        evicted them): the bookkeeping (``hooks.take()``, the rest of ``CostModel._account``)
        is written out. Any other step goes the whole way (:meth:`_step_whole`), which also
        checks what this one assumes."""
        lean = self.lean
        if lean.on:
            if lean.device_loss is None:
                # A CPU run's: the one lean hand-over (also Probe.step's straight way).
                if self.hand_lean_cpu_step(loss, samples, tokens, hooks, t0):
                    return
            # A GPU run's loss: what was backpropagated (None, or that very tensor), a number,
            # or a scalar without a graph on the loss ring's device (copied into it).
            elif (
                lean.opt_end is not None
                and (
                    loss is None
                    or loss is lean.loss
                    or type(loss) is float
                    or (
                        type(loss) is _Tensor
                        and not loss.requires_grad
                        and loss.numel() == 1
                        and self._ring_takes(loss)
                    )
                )
                and (
                    samples is None or (type(samples) in PLAIN_COUNTS and 0 <= samples <= MAX_COUNT)
                )
                and (tokens is None or (type(tokens) in PLAIN_COUNTS and 0 <= tokens <= MAX_COUNT))
                and self._handoff.open
                and self._iterating is None  # a DataLoader's pass began (on another thread)
                # What another thread's taps left for the whole way (a clip, a stray scalar:
                # the loop on another thread than probe.step()'s, which never settles it).
                and self._clip is None
                and self._stray is None
                and self._pending_loss is None
            ):
                self._hand_lean_gpu_step(loss, samples, tokens, hooks, t0)
                return
            self.settle()  # not the usual pattern after all: the whole way
        slots = self._slots
        if (
            len(slots) != 1
            or self._cuda_device is not None
            or self._sample_now
            or self._forced
            or self._amp_skip
            or self._iterating is not None
            or self._pending_loss is not None
            or self._stray is not None
            or self._clip is not None
            or self._rest is not None
            or self._forward_origin is not None
            or self._skipped_layers is not None
            or self._changed_layers is not None
            or not self._handoff.open
        ):
            self._step_whole(loss, samples, tokens, hooks, t0)
            return
        slot = slots[0]
        value = slot.loss  # None: no update since the last step (or its step() raised)
        micro = slot.micro
        if loss is not None and value is not None:
            if micro > 1 and type(loss) is not float:
                # Maybe the last micro-batch's scalar (or a view of it), not the update's
                # loss: the whole way tells them apart.
                self._step_whole(loss, samples, tokens, hooks, t0)
                return
            if loss is self._last_held and self._last_value is not None:
                value = self._last_value  # the very scalar backpropagated, read before
            else:
                value = loss
        lrs = slot.lr
        # A CPU scalar tensor without a graph (``loss.detach()``) is read here, as the whole
        # way's is (the loop may write it again after its step: an accumulator); one with a
        # graph goes the whole way (detached there). So do counts that are not plain ones, and
        # a loss that is not a scalar: what is reported of them says the step it came with.
        if not (
            lrs is not None
            and len(lrs) <= MAX_LR_COLUMNS
            and hooks.timeline.optimizer_start is not None
            and (samples is None or (type(samples) in PLAIN_COUNTS and 0 <= samples <= MAX_COUNT))
            and (tokens is None or (type(tokens) in PLAIN_COUNTS and 0 <= tokens <= MAX_COUNT))
            and (
                type(value) is float
                or (
                    type(value) is _Tensor
                    and value.is_cpu
                    and not value.requires_grad
                    and value.numel() == 1
                )
            )
        ):
            self._step_whole(loss, samples, tokens, hooks, t0)
            return
        if type(value) is _Tensor:
            value = value.item()
        # Start to start, so the step includes probe.step() itself (worked out on the probe
        # thread, as the probe time is: here the readings are only stored).
        last_host = self._last_host
        self._last_host = t0
        # hooks.take(), written out.
        timeline = hooks.timeline
        hooks.timeline = StepTimeline()
        hooks.updating = False  # also after a step() that raised between the hooks
        if hooks._no_grad_ends and timeline.no_grad_start is None:
            hooks.drop_no_grad_ends()  # a step without an evaluation: its forwards' ends unmarked
        slot.loss = slot.lr = None
        slot.micro = 0
        slot.in_step = False
        # Also zero after a step(closure) that raised since the update (its backward counted,
        # its post-hook never ran), as the whole way's _step_losses does.
        self._micro = self._stray_micro = 0
        self._pending_nonfinite = False
        self._last_backward = self._last_kept = self._last_value = None
        # CostModel._account for a step without a gradient pass, on the CPU, written out, less
        # the running averages: the probe thread counts this step into them from what it is
        # handed (fold_costs; tests/probe/test_budget.py holds the two ways to the same figures).
        self._pass_batches += micro or 1
        count = self.step_count + 1
        self.step_count = count
        hook_seconds = self._take_timed(hooks) if TIMED[0] else self._hook_average
        # The next step times itself if it is one of the first (the interval's first figures
        # come from timed steps) or one in TIMED_EVERY.
        TIMED[0] = count < COUNTED_HERE or count % TIMED_EVERY == 0
        whole, self._grad_seconds = self._grad_seconds, 0.0
        self._replanned = False
        # The interval is worked out again by the probe thread as it counts the steps' costs
        # (fold_costs); here only when a pass is due (the costs may have lengthened it since).
        since = count - self._last_sampled
        if since >= self.grad_interval and self.grad_every is None:
            self._replan()
        self._sample_now = since >= self.grad_interval
        # The step ends here, after all its timed work (else the rest would count as the next
        # step's wait for data): the one reading ends both.
        previous_end = self._previous_end
        end = self._previous_end = perf()
        if count <= COUNTED_HERE:
            # The first steps' running averages, kept here (CostModel.fold_costs says why).
            self._fold_here(count - 1, t0, last_host, end, hook_seconds, whole)
        # To the probe thread: a bounded deque, never blocks (the oldest dropped when full).
        handoff = self._handoff
        handoff.steps.append(
            (
                count - 1,
                t0,
                value,
                micro,
                samples,
                tokens,
                lrs,
                last_host,
                timeline,
                previous_end,
                self.epoch,
                end,
                hook_seconds,
                whole,
            )
        )
        handoff.appended += 1
        # The last scalar backpropagated, released after the probe timed itself: where the
        # loop dropped it already, its graph is freed here, the loop's work, not the probe's.
        self._last_held = None
        if HELD:
            HELD.clear()  # nothing of the loop's held past its step (normally empty here)
        self._arm_lean(hooks)

    def _take_timed(self, hooks: PhaseHooks) -> float:
        """On a step whose hooks and taps timed themselves (self_timing): their seconds,
        taken, and counted into the running average an untimed step is counted at."""
        hook_seconds, hooks.seconds = hooks.seconds, 0.0
        tap_seconds = self._tap_seconds
        hook_seconds += tap_seconds[0]
        tap_seconds[0] = 0.0
        average = self._hook_average
        self._hook_average = (
            hook_seconds if average == 0.0 else average + EMA * (hook_seconds - average)
        )
        return hook_seconds

    def hand_lean_cpu_step(
        self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float
    ) -> bool:
        """A CPU run's lean step (lean.py) handed over from its readings (the probe thread
        builds it: pending.usual_record): one optimizer updated once, one micro-batch, a finite
        CPU loss, no pass. True when it was; False when the step is not one after all (the
        caller settles it, or :meth:`step` does). A CPU run's record only (``lean.device_loss``
        None: the callers check it). Called straight from ``probe.step()`` in the steady state
        (Probe.step checked ``lean.on``, the run, the thread and the layout), two Python
        frames fewer than through :meth:`step`: right after the update each frame and
        bytecode costs tens of nanoseconds. The loss passed: the very scalar backpropagated,
        None (that one's), a float, or a CPU scalar without a graph (read here: the loop may
        write it again after its step)."""
        lean = self.lean
        if loss is None or loss is lean.loss:
            value = lean.value
        elif type(loss) is float:
            value = loss
        elif (
            type(loss) is _Tensor
            and loss.is_cpu
            and not loss.requires_grad
            and loss.numel() == 1
            and lean.opt_end is not None
        ):
            value = loss.item()  # a CPU scalar without a graph: read now (the loop may reuse it)
        else:
            return False
        if not (
            lean.opt_end is not None
            and (samples is None or (type(samples) in PLAIN_COUNTS and 0 <= samples <= MAX_COUNT))
            and (tokens is None or (type(tokens) in PLAIN_COUNTS and 0 <= tokens <= MAX_COUNT))
            and self._handoff.open
            and self._iterating is None
            and self._clip is None
            and self._stray is None
            and self._pending_loss is None
        ):
            return False
        last_host = self._last_host
        self._last_host = t0
        count = self.step_count + 1
        self.step_count = count
        self._pass_batches += 1
        self._updated = True  # what the update's post-hook tells an AMP scaler's tap
        hook_seconds = self._take_timed(hooks) if TIMED[0] else self._hook_average
        TIMED[0] = count < COUNTED_HERE or count % TIMED_EVERY == 0
        since = count - self._last_sampled
        if since >= self.grad_interval and self.grad_every is None:
            self._replan()
        due = self._sample_now = since >= self.grad_interval
        previous_end = self._previous_end
        end = self._previous_end = perf()
        if count <= COUNTED_HERE:
            self._fold_here(count - 1, t0, last_host, end, hook_seconds, 0.0, LEAN_SCALE)
        handoff = self._handoff
        handoff.steps.append(
            (
                count - 1,
                t0,
                value,
                samples,
                tokens,
                lean.lrs,  # type: ignore[arg-type]  # set with opt_start
                last_host,
                lean.forward_start,
                lean.forward_end,
                lean.opt_start,
                lean.opt_end,
                previous_end,
                self.epoch,
                end,
                hook_seconds,
            )
        )
        handoff.appended += 1
        lean.forward_start = lean.loss = lean.opt_start = lean.opt_end = None
        if due:  # the next step carries a gradient pass: not lean
            lean.on = False
            hooks.put_pre_back()
        return True

    def _hand_lean_gpu_step(
        self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float
    ) -> None:
        """Hand over a GPU run's lean step (lean.py) from its readings, as a CPU run's is
        (:meth:`hand_lean_cpu_step`), its loss into the loss ring: one optimizer updated once,
        one micro-batch, a device loss, no pass. (Its count and plans are the CPU one's, which
        has them written out rather than in a shared call: a frame there is paid every step;
        tests/probe/test_lean.py holds both to the whole way's records.)"""
        lean = self.lean
        last_host = self._last_host
        self._last_host = t0
        count = self.step_count + 1
        self.step_count = count
        self._pass_batches += 1
        self._updated = True  # what the update's post-hook tells an AMP scaler's tap
        hook_seconds = self._take_timed(hooks) if TIMED[0] else self._hook_average
        TIMED[0] = count < COUNTED_HERE or count % TIMED_EVERY == 0
        # (No work timed whole on a lean step: no pass, no guard, nothing staged.)
        since = count - self._last_sampled
        if since >= self.grad_interval and self.grad_every is None:
            self._replan()
        due = since >= self.grad_interval
        self._sample_now = due
        # The loss into the ring before the step's end is read: its CUDA call is the probe's
        # time, as the whole way's copy is.
        value, ring_kept = self._ring_place(
            lean.value if loss is None or loss is lean.loss else loss
        )
        end = self._previous_end = perf()
        if count <= COUNTED_HERE:
            # The first steps' running averages, kept here (CostModel.fold_costs says why).
            self._fold_here(count - 1, t0, last_host, end, hook_seconds, 0.0, LEAN_SCALE)
        self._hand_lean_device_step(
            count, t0, value, samples, tokens, last_host, end, hook_seconds, hooks
        )
        # What the hooks test (the rest is written before it is read: lean.py).
        lean.forward_start = lean.loss = lean.opt_start = lean.opt_end = None
        # The next step carries a gradient pass or has its phases timed, or the ring was
        # given up: not lean.
        if due or not ring_kept or self._marked:
            lean.on = False
            hooks.put_pre_back()

    def _ring_place(self, value: Any) -> tuple[Any, bool]:
        """A GPU run's lean step's loss (``value``: None for the device scalar the backward
        kept unread) copied into the loss ring: its place there (or its batch of its own where
        the ring did not keep it), else ``value`` as it is; and whether the ring is still
        kept (a GPU's lean step needs one)."""
        lean = self.lean
        device_loss: Any = None  # what goes into the ring: a device scalar without a graph
        if value is None:
            loss = lean.loss  # the backward's device scalar, kept unread
            if loss is not None:
                device_loss = loss.detach() if loss.requires_grad else loss
        elif type(value) is _Tensor and not (value.is_cpu and taps.READ_ON_HOST):
            device_loss = value  # a device scalar passed (``loss.detach()``)
        if device_loss is None:
            return value, True
        ring = self._loss_ring
        kept = ring.add(device_loss) if ring is not None and ring.spoiled is None else None
        # Not kept: the ring given up during this step, or its slots not read back yet.
        place = kept if kept is not None else copied_now(device_loss)
        if ring is None or ring.spoiled is not None:
            self._drop_ring()
            return place, False
        return place, True

    def _hand_lean_device_step(
        self,
        count: int,
        t0: float,
        place: Any,
        samples: Any,
        tokens: Any,
        last_host: float | None,
        end: float,
        hook_seconds: float,
        hooks: PhaseHooks,
    ) -> None:
        """A GPU run's lean step handed over, its loss in the ring (``place``: _ring_place),
        its phases unmarked (an untimed GPU step's are NaN: the host's clock is not the
        device's), and the next step's marks planned, as the whole way plans them."""
        lean = self.lean
        handoff = self._handoff
        handoff.steps.append(
            (
                count - 1,
                t0,
                place,
                samples,
                tokens,
                lean.lrs,  # type: ignore[arg-type]  # set with opt_start
                last_host,
                None,
                None,
                None,
                None,
                None,
                self.epoch,
                end,
                hook_seconds,
            )
        )
        handoff.appended += 1
        self._plan_marks(hooks)
        if self._marked:
            self._previous_end = self._mark()  # the next step's data gap starts here

    def _arm_lean(self, hooks: PhaseHooks) -> None:
        """Whether the next step starts lean (lean.py): a CPU run's one optimizer, no pass due,
        no guard, nothing else the full bookkeeping has to do on its way, this probe the only
        one listening to the taps."""
        slots = self._slots
        self.lean.on = (
            lean_switch.ENABLED
            and (
                self._cuda_device is None
                # A GPU run's steps between its timed ones, where the host sets the pace (the
                # whole way's host time is hidden behind the device's where it does not).
                or (
                    self._loss_ring is not None
                    and self._loss_ring.spoiled is None
                    and not self._marked
                    and not self._hidden
                )
            )
            and len(slots) == 1
            and not self._sample_now
            and not self._forced
            and slots[0].guard is None
            and self._rest is None
            and self._iterating is None
            and self._forwards_seen
            and not self.layout_dirty
            and self._handoff.open
            and hooks.active
            and not hooks._no_grad_ends
            and taps.lean_record() is self.lean
        )
        # The step pre-hook out of the way while steps are lean, back when not (PhaseHooks).
        if self.lean.on:
            if self.lean.optimizer is None:
                hooks.take_pre_out(slots[0].key, slots[0].optimizer)
        elif self.lean.optimizer is not None:
            hooks.put_pre_back()

    def settle(self) -> None:
        """A lean step is not one after all (lean.py): what the hooks and taps wrote of it so
        far goes into the full bookkeeping, in order, with the readings they took, as their
        whole way would have put it; the step goes on the whole way."""
        lean = self.lean
        if not lean.on:
            return
        lean.on = False
        hooks = self.phases
        try:
            if hooks is None:
                return
            if lean.opt_start is None:
                # Its update has not begun: the step pre-hook back where it was, to run next.
                # (Once begun, torch may be iterating over the pre-hooks: back at the step's
                # end then, and the optimizer tap hands it anything before that.)
                hooks.put_pre_back()
            timeline = hooks.timeline
            if lean.forward_start is not None:
                timeline.forward_start = lean.forward_start
                hooks.forward_pending = True
            if lean.loss is not None:
                self.on_backward(lean.loss, lean.value, lean.forward_end)
            if lean.opt_start is not None and self._slots:
                # _StepStart's usual update (nothing due, no guard: the step was lean).
                slot = self._slots[0]
                timeline.optimizer_start = lean.opt_start
                hooks.updating = True
                slot.in_step = True
                slot.closure_loss = None
                slot.closure_nonfinite = False
                slot.lr = lean.lrs
                if lean.opt_end is not None:
                    timeline.optimizer_end = lean.opt_end
                    hooks.updating = False
                    self.on_optimizer_post(slot.key)
        finally:
            lean.clear()

    def _step_whole(
        self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float
    ) -> None:
        """Any step that is not a usual CPU one, the whole way (see :meth:`step`)."""
        if self._iterating is not None:
            self._note_loader()
        if not TIMED[0]:
            # Its hooks and taps did not time themselves (a usual step came before: see
            # self_timing): their fixed work at the timed steps' average, plus the work timed
            # whole they ran (a gradient pass: always timed).
            hooks.seconds = self._hook_average + self._grad_seconds
            TIMED[0] = True  # and the next step times itself
        if not self._handoff.open:
            self._drop_unread_step(hooks)
            return
        # Start to start, so the step includes probe.step() itself (and a gradient pass in it).
        step_time = NAN if self._last_host is None else t0 - self._last_host
        self._last_host = t0
        end = self._hand_whole_step(loss, samples, tokens, hooks, t0, step_time)
        self._last_held = None
        if HELD:
            HELD.clear()
        if self._cuda_device is not None:
            self._plan_marks(hooks)
        self._previous_end = end if end is not None else self._mark()
        # Nothing left over in the record (a tap on another thread may write it after a
        # settle): a step armed lean starts from nothing.
        self.lean.clear()
        self._arm_lean(hooks)

    def _drop_unread_step(self, hooks: PhaseHooks) -> None:
        """Nobody can ever read what this step would record: keep nothing, compute nothing."""
        self.step_count += 1
        self._sample_now = False
        if self._cuda_device is not None:  # no CUDA event for a step nobody reads
            self.use_marks(hooks, False)
        self.forget_step()
        hooks.take()
        hooks.seconds = 0.0
        taps.take_seconds()

    def _hand_whole_step(
        self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float, step_time: float
    ) -> Mark | None:
        """Hand over any step that is not a usual one, every case checked: several optimizers,
        a gradient pass, a device loss, accumulation, AMP's skipped update, a NaN's evidence.
        Returns the mark whose CUDA event ends the step, when its copy records one."""
        slots = self._slots
        timeline = hooks.take()
        hidden = self._hidden
        previous = self._previous_end
        if type(previous) is CudaMark:
            # The device has not finished the step before while the host is done with this
            # one: the host runs a step or more ahead (the GPU is the bottleneck), and its
            # work, the probe's with it, hides behind the device's. Asked, not waited for;
            # only where the step before ended in an event (a timed step's neighbours): the
            # steps between are taken to be as the last one asked (each query costs ~15 us
            # of host time on an H200).
            hidden = self._hidden = not previous.event.query()
        # Where the backward ends when no optimizer hook marked it (optimizer=None, manual
        # updates); otherwise not made: on a GPU each mark is an event, microseconds a step.
        step_mark = self._mark() if timeline.optimizer_start is None else None
        loss, per_optimizer, micro = self._step_losses(loss)
        amp_skip = self._amp_skip
        weights_only = False
        if amp_skip:
            # GradScaler skipped this update: routine, no gradient of it is shown. Only a
            # non-finite loss of its own (not the scale's overflow) is a NaN to trace: its
            # weights are read (the gradients are scaled), as on any non-finite step.
            weights_only = host_nonfinite(loss)
            if weights_only:
                self._forward_origin = self._amp_forward
            self._forget_amp_skip()
            for slot in self._slots:
                slot.sample = None
            self._rest_sample = None
            self._forced = weights_only and not self._sample_now
            sample = self._take_samples(weights_only, weights_only) if weights_only else None
        else:
            force_rest = (
                not self._sample_now
                and self._rest is not None
                and self._rest_sample is None
                and host_nonfinite(loss)
            )
            self._forced = self._forced or force_rest
            # A pass ran (or runs now) only on a step due or forced: others skip the call.
            due = self._sample_now or self._forced
            sample = self._take_samples(force_rest) if due else None
        # The usual step's values inline (a loss tensor, one optimizer's LRs, counts that are
        # plain numbers): each Python function entered here, after the update, costs
        # microseconds to fetch again. Anything else goes through the helpers that check it.
        loss_value: float | None
        loss_tensor: torch.Tensor | None
        if type(loss) is float:
            loss_value, loss_tensor = loss, None
        elif isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss_value, loss_tensor = None, loss.detach() if loss.requires_grad else loss
        else:
            loss_value, loss_tensor = self._loss_parts(loss)
        clip, self._clip = self._clip, None
        if amp_skip:
            clip = None  # the clip of an update that did not happen
        lrs = slots[0].lr if len(slots) == 1 else None
        if lrs is not None and len(lrs) <= MAX_LR_COLUMNS:
            slots[0].lr = None
        else:
            lrs = self._step_lrs()
        # Set field by field (PendingStep has its defaults on the class, no __init__).
        pending = PendingStep()
        pending.step = self.step_count
        pending.time = time.time()
        pending.lr = lrs
        pending.step_time = step_time
        if samples is not None:
            pending.samples = (
                float(samples)
                if type(samples) in PLAIN_COUNTS and 0 <= samples <= MAX_COUNT
                else self._count(samples, "samples")
            )
        if tokens is not None:
            pending.tokens = (
                float(tokens)
                if type(tokens) in PLAIN_COUNTS and 0 <= tokens <= MAX_COUNT
                else self._count(tokens, "tokens")
            )
        pending.timeline = timeline
        pending.previous_end = self._previous_end
        pending.step_mark = step_mark
        pending.unmarked = not self._marked
        pending.loss = loss_value
        if micro:
            pending.micro_batches = float(micro)
        if clip is not None:
            pending.clip_max = clip[0]
        pending.epoch = self.epoch
        pending.grad_marks, self._grad_marks = self._grad_marks, None
        pending.forward_origin, self._forward_origin = self._forward_origin, None
        pending.skipped_layers, self._skipped_layers = self._skipped_layers, None
        pending.changed_layers, self._changed_layers = self._changed_layers, None
        pending.amp_skipped = amp_skip
        self._forced = False
        if sample is not None:
            pending.grads = sample
            pending.weights_only = weights_only
            if not weights_only:
                pending.missing_layers = sample.missing
        scalars = per_optimizer
        if loss_tensor is not None:
            scalars["loss"] = loss_tensor
        if clip is not None:
            scalars["clip_norm"] = clip[1]
        updates = self._take_updates(pending)
        histograms = self._take_histograms(pending)
        usual = (
            sample is None
            and updates is None
            and histograms is None
            and pending.update_ratios is None
            and len(scalars) == 1
            and loss_tensor is not None
        )
        kept = (
            self._keep_loss(loss_tensor)  # type: ignore[arg-type]
            if usual and self._loss_ring is not None
            else None
        )
        if kept is not None:
            # The usual GPU step: its loss copied into the ring on the device, read back with
            # the others of its tick in one copy (loss_ring.py): no copy to the host here.
            pending.loss_batch, pending.loss_index = kept
            end = None
        elif usual and loss_tensor.is_cpu:  # type: ignore[union-attr]
            pending.loss = float(loss_tensor.item())  # type: ignore[union-attr]  # a usual CPU step
            end = None
        elif scalars or sample is not None or updates is not None or histograms is not None:
            staged = perf()  # device values and a sampled step's norms: timed whole
            end = stage_values(pending, sample, scalars, self._cuda_device, updates, histograms)
            self._grad_seconds += perf() - staged
        else:
            end = None

        probe_time = self._account(t0, hooks, step_time, sample, hidden, micro)
        pending.probe_time = probe_time
        # To the probe thread: a bounded deque, never blocks (the oldest dropped when full).
        handoff = self._handoff
        handoff.steps.append(pending)
        handoff.appended += 1
        return end

    def _ring_takes(self, loss: torch.Tensor) -> bool:
        """On a GPU run's lean step: whether ``loss``, a scalar without a graph passed to
        probe.step(), can go into the loss ring: the ring is kept and the scalar is on its
        device, and a plain tensor (a subclass's ``copy_`` may raise, a DTensor's does: it
        goes the whole way's own copy instead, the ring kept for the other steps)."""
        ring = self._loss_ring
        return (
            ring is not None
            and ring.spoiled is None
            and type(loss) is _Tensor
            and loss.device == ring.device
        )

    def _keep_loss(self, loss: torch.Tensor) -> tuple[Any, int] | None:
        """A usual GPU step's loss (a scalar the step passed) copied into the loss ring: its
        batch and place. None where it is copied to the host at its step instead: the ring
        given up (said once) or a whole ring behind, or the scalar on another device."""
        ring = self._loss_ring
        if ring is None:
            return None
        if self._ring_takes(loss):
            kept = ring.add(loss.detach() if loss.requires_grad else loss)
            if kept is not None:
                return kept
        if ring.spoiled is not None:
            self._drop_ring()
        return None

    def _drop_ring(self) -> None:
        """Give the loss ring up (it says why): each GPU step's loss copied at its step."""
        ring, self._loss_ring = self._loss_ring, None
        self._handoff.ring = None
        why = ring.spoiled if ring is not None else None
        if why:
            self.report_once(
                "loss-ring",
                f"{why}: each step's loss is copied to the host at its step from now on"
                " (about 100 us of host time a step on a GPU)",
            )

    def _take_updates(self, pending: PendingStep) -> torch.Tensor | None:
        """This step's update ratios: the layers go on ``pending``; ratios on the host are kept
        there as they are, device ones are returned to join the step's one copy."""
        layers: list[int] = []
        parts: list[torch.Tensor] = []
        for slot in self._slots:
            result, slot.update_result = slot.update_result, None
            if slot.measuring and slot.updates is not None:
                slot.updates.drop()  # copied, and no update came (its step() raised): free it
            slot.measuring = False
            if result is not None:
                layers.extend(result[0])
                parts.append(result[1])
        if not parts:
            return None
        pending.update_layers = layers
        ratios = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])
        if ratios.is_cpu:
            pending.update_ratios = ratios
            return None
        return ratios

    def _take_histograms(self, pending: PendingStep) -> torch.Tensor | None:
        """This step's histograms: what they cover goes on ``pending``; counts on the host are
        kept there as they are, device ones are returned to join the step's one copy."""
        parts: list[HistogramPart] = []
        for slot in self._slots:
            part, slot.histogram_result = slot.histogram_result, None
            if part is not None:
                parts.append(part)
        if not parts:
            return None
        joined = HistogramPart.join(parts)
        pending.histograms = joined
        if joined.values.is_cpu:
            return None
        return joined.values

    def step_failed(self, count: int, t0: float) -> None:
        """``probe.step()`` raised (an internal error, counted) with ``count`` steps before it
        and its start at ``t0``: the step keeps its number where it was not counted (missing
        from the records, as a dropped step is), so the later ones keep the loop's count, and
        the next step's time starts at this one's start, not a step earlier."""
        if self.step_count == count:
            self.step_count = count + 1
            self._last_host = t0

    def forget_step(self) -> None:
        """Drop what the probe holds of the step in progress (the loop's last scalar and its
        graph included): a step nobody can read, a ``probe.step()`` that failed, a probe
        closed or switched off."""
        self.lean.on = False
        self.lean.clear()
        if self.phases is not None:
            self.phases.put_pre_back()
        for slot in self._slots:
            slot.sample = slot.loss = slot.lr = None
            slot.micro = 0
        self._pending_loss = self._clip = self._rest_sample = self._stray = None
        self._pending_nonfinite = False
        self._micro = self._stray_micro = 0
        self._grad_marks = None
        self._forced = False
        self._changed_layers = self._last_backward = self._forward_origin = None
        self._last_value = self._last_kept = self._last_held = None
        HELD.clear()
        self._drop_updates()
        self._forget_amp_skip()
