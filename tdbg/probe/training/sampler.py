"""The probe's per-step work on the training thread: loss, LR, the gradient pass, its cost."""

from __future__ import annotations

import math
import random
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tdbg.probe.alerts import alert
from tdbg.probe.device_copy import host_copy
from tdbg.probe.log import warn
from tdbg.probe.training import taps
from tdbg.probe.training.budget import FIXED_UNTIMED, gradient_interval
from tdbg.probe.training.gradients import GradientStats, GradSample, Layer
from tdbg.probe.training.guard import NonfiniteGuard, find_forward_origin
from tdbg.probe.training.hooks import CudaMark, Mark, PhaseHooks, StepTimeline, marker, perf
from tdbg.probe.training.inbox import Inbox
from tdbg.probe.training.pending import PendingStep, SkippedUpdate, UsualStep
from tdbg.protocol.steps import MAX_LR_COLUMNS, MAX_PHASE_GAP

NAN = float("nan")
INF = float("inf")
_STRAY = object()  # on_backward's note that the latest backward was kept aside
_PLAIN = (int, float)  # samples= / tokens= types read as they are (bool is not one of them)
# The largest count read as it is: an int past it (10**400) has no float; _count reports it.
MAX_COUNT = sys.float_info.max
_Tensor = torch.Tensor
_FIXED_SCALE = 1.0 + FIXED_UNTIMED  # what the fixed work costs the loop per second it timed
REPORTS_PER_KIND = 3  # report_once: distinct reports of one kind of problem before a count
FOLDED = {  # report_once: what the count of one kind says
    "metric-type": "tdbg.log values that are not numbers",
    "metric-shape": "tdbg.log tensors that are not one number",
    "metric-complex": "complex tdbg.log values",
    "metric-overflow": "tdbg.log ints past a float's range",
    "metric-name": "tdbg.log names that are not strings",
}
EMA = 0.1  # weight of the newest value in the running averages of step time and costs
# Weight of the newest step in the probe's spent fraction (its time over the step's): ~100
# steps' memory, like the 200-step window of the cost_fraction it reports.
SPENT_EMA = 0.01
# A GPU run's steps at least this long (seconds) each have their phases timed with CUDA events;
# shorter ones one step in ceil(this / step) on average, at most MAX_PHASE_GAP apart: the ~5
# events a timed step records cost tens of microseconds of host time, several percent of a
# 2 ms launch-bound step (benchmarks/HISTORY.md, "On a GPU").
MARK_EVERY_STEP_FROM = 0.02
# The mean distance between timed steps is at most this: random distances up to twice it
# less one stay within MAX_PHASE_GAP.
MAX_MEAN_GAP = MAX_PHASE_GAP // 2


def _number(value: Any) -> float:
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return NAN


def _host_nonfinite(value: Any) -> bool:
    """A loss known to be NaN or Inf without a host-device sync: a Python float or a CPU
    tensor (reading one is a memory load). A device tensor is never read here: False."""
    if isinstance(value, torch.Tensor):
        return taps.nonfinite_on_host(value)
    return isinstance(value, float) and not math.isfinite(value)


def _as_loss(value: Any) -> Any:
    """A backpropagated scalar as a loss to add up or keep: a CPU loss's value as it is (a
    float, read by the backward tap), a device one detached, float32 or wider."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad:
        value = value.detach()
    return value if value.dtype == torch.float32 or value.dtype == torch.float64 else value.float()


@dataclass
class OptimizerSlot:
    """One watched optimizer and what this step learnt from its hooks."""

    key: int  # stable: the hooks name the slot by it
    optimizer: torch.optim.Optimizer
    name: str
    grads: GradientStats  # over the watched parameters it updates
    lr: list[float] | None = None  # read at its step pre-hook: the LR this update uses
    loss: Any = None  # the scalars backpropagated for this update: a float, or a device tensor
    sample: GradSample | None = None
    in_step: bool = False
    # The first scalar backpropagated inside step(closure), kept as on_backward keeps one.
    closure_loss: Any = None
    closure_nonfinite: bool = False  # that scalar was read NaN or Inf (a CPU one, no sync)
    guard: NonfiniteGuard | None = None  # watch(skip_nonfinite=True)
    micro: int = 0  # the scalars backpropagated for this update (micro-batches)


class StepSampler:
    """Everything ``probe.step()`` and the hooks do on the training thread.

    Per step: the loss (never read from the device here), the learning rates, the step's
    timeline, and — every ``grad_interval`` steps, chosen to stay within ``overhead_budget``
    unless ``grad_every`` fixes it — one fused gradient pass per optimizer, on the gradients its
    update uses (before any clipping); the step goes to the probe thread's inbox with its one
    device-to-host copy in flight. O(1) Python, no sync.

    It also listens to the process-wide taps (:mod:`tdbg.probe.training.taps`): the scalars
    backpropagated since the last update (summed: gradient accumulation; the first inside a
    closure), ``clip_grad_norm_`` calls (their max_norm and measured norm, and a chance to read
    the gradients before they are scaled) and DataLoader passes (the epoch).
    """

    # Slots: its ~65 attributes are past what an instance dict shares keys for, so each read
    # was a lookup in a large hash table, which the loop's kernels evict from the caches every
    # step; as slots the per-step ones sit in one small block (~10 us less a step on the cnn
    # demo, timed at the probe's entry points). ``__dict__`` stays for what tests patch.
    __slots__ = (
        "_amp_forward",
        "_amp_loss",
        "_amp_micro",
        "_amp_skip",
        "_by_key",
        "_changed_layers",
        "_checked",
        "_clip",
        "_clip_covers",
        "_count_error",
        "_cuda_device",
        "_dataset",
        "_fixed_cost",
        "_folded",
        "_forced",
        "_forwards_seen",
        "_forward_origin",
        "_grad_cost",
        "_grad_device_cost",
        "_grad_marks",
        "_grad_seconds",
        "_iterating",
        "_last_backward",
        "_last_held",
        "_last_host",
        "_last_kept",
        "_last_sampled",
        "_last_value",
        "_loader",
        "_mark",
        "_cuda_mark",
        "_next_marked",
        "_mark_rng",
        "_marked",
        "_micro",
        "_n_layers",
        "_n_trainable",
        "_pass_batches",
        "_pass_length",
        "_pending_before",
        "_pending_loss",
        "_pending_nonfinite",
        "_previous_end",
        "_reported",
        "_replanned",
        "_rest",
        "_rest_sample",
        "_sample_now",
        "_handoff",
        "_skipped_layers",
        "_slots",
        "_spent_probe",
        "_spent_step",
        "_tap_seconds",
        "_step_ema",
        "_stray",
        "_stray_before",
        "_stray_micro",
        "_steps_at_iter",
        "_updated",
        "amp_skipped_steps",
        "captured",
        "epoch",
        "epoch_given",
        "grad_every",
        "grad_interval",
        "layout_dirty",
        "new_optimizers",
        "unplaced_optimizers",
        "optimizer_seen",
        "overhead_budget",
        "phases",
        "skip_nonfinite",
        "skipped_steps",
        "step_count",
        "watched_modules",
        "watched_params",
        "__dict__",
        "__weakref__",
    )

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
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0  # updates the guard skipped
        # The root module and arguments of the latest forward (PhaseHooks.last_inputs), for
        # re-running a non-finite step's forward while its weights are intact.
        self.captured: Callable[[], tuple[Any, Any, Any] | None] = lambda: None
        # The hooks whose timeline the backward tap marks the forward's end on (set by the
        # probe with its hooks).
        self.phases: PhaseHooks | None = None
        self._forward_origin: tuple[str, str, int] | None = None
        self._skipped_layers: SkippedUpdate | None = None
        self._slots: list[OptimizerSlot] = []
        self._by_key: dict[int, OptimizerSlot] = {}
        self._rest: GradientStats | None = None
        # (parameters' key, slot keys, covers the rest): what the last clip's list covered.
        self._clip_covers: tuple[tuple[int, ...], list[int], bool] | None = None
        self._n_layers = 0
        self._n_trainable = 0
        self.rebuild(layers, [(i, name, opt) for i, (name, opt) in enumerate(optimizers)])
        self.layout_dirty = False  # a watched module changed, or a new optimizer updates it
        self.new_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        # Optimizers first seen while the layers were about to change (on_any_optimizer_step).
        self.unplaced_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        # Told of each optimizer the probe's tap sees for the first time that it does not watch
        # (tdbg run warns of one that trains the model after its own discovery ended).
        self.optimizer_seen: Callable[[torch.optim.Optimizer], None] | None = None
        self.watched_modules: set[int] = set()  # ids of every module of the watched models
        self.watched_params: set[int] = set()
        # Optimizers looked at, by id (checked against the weakref: ids are reused): a dict
        # lookup per step of any optimizer, where a WeakSet's made a weakref each time.
        self._checked: dict[int, weakref.ref[Any]] = {}
        self._cuda_device = cuda_device
        # What marks the step's phases: on a GPU run a CUDA event on timed steps (_marked) and
        # the host clock on the others (see _plan_marks); the clock alone on the CPU.
        self._cuda_mark = marker(cuda_device)
        self._mark = self._cuda_mark
        self._marked = True
        self._next_marked = 0  # the next step whose phases a GPU run times
        # Random distances between timed steps, from a generator of the probe's own (the
        # loop's random state is the loop's): at a fixed period they would fall on the same
        # point of a periodic pattern (a DataLoader's workers delivering in lockstep: one long
        # wait every W steps) and read it as always or never there.
        self._mark_rng = random.Random(0x7D6)
        self._handoff = handoff
        self._count_error = count_error
        self.grad_every = grad_every
        self.overhead_budget = overhead_budget
        self.step_count = 0
        self._sample_now = True
        self._last_sampled = -1
        self.grad_interval = grad_every or 1
        self._grad_cost = 0.0  # EMA of what a step with a gradient pass costs on top
        self._step_ema = 0.0  # EMA of seconds per step
        # This step's work timed whole (not scaled by FIXED_UNTIMED: its timers see it all):
        # gradient passes, the guard's check, a forward re-run, staging device values.
        self._grad_seconds = 0.0
        self._fixed_cost = 0.0  # EMA of the probe's cost on a step without a gradient pass
        self._replanned = False  # this step's pass also planned the layout (not typical)
        self._previous_end: Mark | None = None
        self._grad_marks: tuple[Mark, Mark] | None = None
        self._grad_device_cost = 0.0  # EMA of the gradient pass's device time (GPU runs)
        self._spent_probe = self._spent_step = 0.0  # slow EMAs of probe and step seconds
        self._tap_seconds = taps.tap_seconds  # the taps' time, taken at each step
        self._last_host: float | None = None
        # report_once: per kind of problem, the keys reported so far (at most
        # REPORTS_PER_KIND) and how many more were folded into a count.
        self._reported: dict[str, set[str]] = {}
        self._folded: dict[str, int] = {}
        # From the taps, since the last probe.step():
        self._pending_loss: Any = None  # backpropagated, not yet given to an optimizer
        # One of those scalars was read NaN or Inf before its backward (a CPU one: no sync).
        self._pending_nonfinite = False
        self._micro = 0  # backward calls of a scalar
        # Backward calls with no watched model's forward since the last step (a copy of the
        # model trained aside, an unrelated tensor): not the step's loss unless there is no
        # other (a loop that runs the next forward before probe.step()). Told apart only once
        # a watched forward was seen marking a step (not where forwards are compiled).
        self._stray: Any = None
        self._stray_before: Any = None  # the sum before the latest (restored if it fails)
        self._stray_micro = 0
        self._forwards_seen = False
        self._clip: tuple[float, Any] | None = None  # (max_norm, the norm clip measured)
        self._rest_sample: GradSample | None = None  # read inside a clip (no optimizer)
        self.epoch: float = NAN
        self.epoch_given = False  # set_progress(epoch=) wins over DataLoader detection
        self._loader: Any = None  # weakref to the DataLoader whose passes count as epochs
        self._iterating: Any = None  # (weakref, dataset id) of the DataLoader last started
        self._dataset = 0  # id of the training DataLoader's dataset
        self._pass_length: int | None = None  # its batches per pass, when it knows
        self._pass_batches = 0  # batches backpropagated since its pass began (micro-batches)
        self._steps_at_iter = 0
        self._updated = False  # an optimizer stepped since the last GradScaler.update()
        # Where a NaN began, on steps whose gradients are not sampled: a non-finite loss read
        # without a sync (a CPU loss) forces this step's pass of weights and gradients before
        # the update spreads it (_forced); the layers whose weights other code than the
        # optimizer changed (parameter version counters, CPU runs) tell a weight set to NaN
        # from one an update made so (GradientStats.changed_layers).
        self._forced = False
        self._changed_layers: list[int] | None = None
        self._last_backward: torch.Tensor | None = None  # the last scalar backpropagated
        self._last_held: torch.Tensor | None = None  # it, as the loop passed it (see step())
        self._last_value: float | None = None  # its value, when the tap read it (CPU)
        self._last_kept: Any = None  # what on_backward kept of it (taken back if it fails)
        self._pending_before: Any = None  # the sum before it was added (restored if it fails)
        # GradScaler skipped this iteration's update (inf/NaN gradients at its scale): what
        # was backpropagated for it, and whether its forward origin was looked for.
        self._amp_skip = False
        self._amp_loss: Any = None
        self._amp_micro = 0
        self._amp_forward: tuple[str, str, int] | None = None
        self.amp_skipped_steps = 0

    @property
    def optimizer_names(self) -> list[str]:
        return [slot.name for slot in self._slots]

    def rebuild(
        self, layers: list[Layer], optimizers: list[tuple[int, str, torch.optim.Optimizer]]
    ) -> None:
        """(Re)build the gradient passes: one per optimizer over the watched parameters it
        updates, one for the rest. At watch() and at a step boundary after the watched layers
        changed; a slot kept (same key) keeps what this step already learnt from its hooks."""
        self._clip_covers = None  # the parameter sets changed: what a clip covers too
        current = [layer for layer in layers if layer.params]
        watched = {id(p) for layer in current for p in layer.params}
        slots: list[OptimizerSlot] = []
        held: set[int] = set()
        for key, name, optimizer in optimizers:
            # A parameter two optimizers hold is read with the first one's update.
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]} & watched - held
            held |= ids
            stats = GradientStats(layers, ids)
            slot = self._by_key.get(key)
            if slot is None or slot.optimizer is not optimizer:
                slot = OptimizerSlot(key, optimizer, name, stats)
            slot.grads = stats
            if self.skip_nonfinite:
                slot.guard = NonfiniteGuard(stats.params, stats.param_layer)
            slots.append(slot)
        self._slots = slots
        self._by_key = {slot.key: slot for slot in slots}
        # Parameters no optimizer updates (manual updates, optimizer=None): read at probe.step().
        rest = watched - held
        self._rest = GradientStats(layers, rest) if rest else None
        self._n_layers = len(layers)
        self._n_trainable = sum(1 for layer in current if layer.trainable)

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

    def report_once(self, key: str, message: str) -> None:
        """Tell the user once (stderr and an alert) about a problem with what the loop passes.

        ``key`` is ``KIND`` or ``KIND:DETAIL`` (a metric's name, a type): each key once, and
        at most REPORTS_PER_KIND keys per kind; past those, a count (at 1, 10, 100, ...) — so
        thousands of badly logged names cost a handful of lines, not one each."""
        kind = key.partition(":")[0]
        seen = self._reported.setdefault(kind, set())
        if key in seen:
            return
        if len(seen) < REPORTS_PER_KIND:
            seen.add(key)
            self._tell(message)
            return
        folded = self._folded[kind] = self._folded.get(kind, 0) + 1
        if str(folded).rstrip("0") == "1":  # 1, 10, 100, ...: a log-bounded count
            what = FOLDED.get(kind, "problems like these")
            self._tell(f"{folded} more {what} (dropped; not reported one by one)")

    def _tell(self, message: str) -> None:
        warn(f"tdbg: {message}")
        self._handoff.alerts.append(alert("probe_error", "warning", self.step_count, message))

    # --- optimizer hooks (hooks.OptimizerEvents) ------------------------------------------------
    def on_optimizer_pre(self, key: int, grads_ready: bool = False) -> None:
        """The optimizer ``key``'s step begins. ``grads_ready``: its gradients are the ones the
        update uses (a step without a closure): :meth:`on_grads_ready` follows, entered only
        where it has anything to do (a pass due or forced, the guard)."""
        slot = self._by_key.get(key)
        if slot is None:
            return
        slot.in_step = True
        slot.closure_loss = None
        slot.closure_nonfinite = False
        # The learning rates the update uses (read before a scheduler changes them). Plain
        # floats, nearly always: read here, in the cold moment after the backward, without
        # entering _learning_rates.
        lrs: list[float] = []
        for group in slot.optimizer.param_groups:
            lr = group.get("lr")
            if type(lr) is not float:
                lrs = self._learning_rates(slot.optimizer)  # a tensor, a number of another type
                break
            lrs.append(lr)
        slot.lr = lrs
        if self._amp_skip:
            self._forget_amp_skip()  # an update runs: the skipped one got no probe.step()
        if grads_ready and (
            slot.guard is not None
            or (
                slot.sample is None
                and (self._sample_now or self._forced or self._pending_nonfinite)
            )
        ):
            self.on_grads_ready(key)

    def on_grads_ready(self, key: int) -> None:
        slot = self._by_key.get(key)
        if slot is None:
            return
        nonfinite = False
        # A loss the backward tap read non-finite (a CPU one: no sync) forces the pass.
        loss_nonfinite = slot.closure_nonfinite or self._pending_nonfinite
        if slot.sample is None and (self._sample_now or self._forced or loss_nonfinite):
            # A step not due for sampling whose loss is already non-finite: measured anyway,
            # once, weights too, before this update spreads the NaN (where it began needs it).
            self._forced = not self._sample_now
            sample = self._compute_grads(slot.grads, weights=self._forced)
            if sample is not None:  # checked once, where it was read (a clip reads it first)
                sample, nonfinite = self._check_host(slot.grads, sample)
            slot.sample = sample
        if slot.guard is not None:
            # One sync per update, the price of keeping the model intact (README). Timed whole,
            # as a pass is: a read of every gradient, not the hooks' few cold lines.
            t0 = perf()
            skip = slot.guard.check_and_skip()
            self._grad_seconds += perf() - t0
            if skip:
                if self._skipped_layers is None:
                    self.skipped_steps += 1
                    self._skipped_layers = SkippedUpdate(self.skipped_steps)
                self._skipped_layers.extend(slot.guard.nonfinite_layers)
                self._find_forward_origin()
        elif nonfinite:
            # On the CPU the norms are already computed: checking them costs no sync. A
            # non-finite one: re-run the forward now, before this update spreads NaN.
            self._find_forward_origin()

    def _check_host(self, stats: GradientStats, sample: GradSample) -> tuple[GradSample, bool]:
        """(the sample, whether it is non-finite) for a gradient pass whose values are on the
        host (CPU): checking them costs no sync. A NaN or Inf: the weights are read now too,
        before the update (where it began), and the layers whose weights code other than the
        optimizer changed since the last pass are noted. A device pass: as it is, False."""
        if not sample.host_nonfinite():
            return sample, False
        changed = stats.changed_layers()
        if changed is not None:
            self._changed_layers = sorted({*(self._changed_layers or ()), *changed})
        return stats.with_weights(sample), True

    def _find_forward_origin(self) -> None:
        captured = self.captured()
        if captured is not None and self._forward_origin is None:
            module, args, kwargs = captured
            t0 = perf()  # a whole forward, timed whole (as a gradient pass is)
            self._forward_origin = find_forward_origin(module, args, kwargs)
            self._grad_seconds += perf() - t0

    # Kept as a name: the gradient pass of the first optimizer (tests patch it to fail).
    def on_optimizer_step(self) -> None:
        if self._slots:
            self.on_grads_ready(self._slots[0].key)

    def on_optimizer_post(self, key: int) -> None:
        slot = self._by_key.get(key)
        if slot is None:
            return
        slot.in_step = False
        self._updated = True
        closure, slot.closure_loss = slot.closure_loss, None
        pending, self._pending_loss = self._pending_loss, None
        slot.closure_nonfinite = self._pending_nonfinite = False
        slot.micro, self._micro = self._micro, 0  # this optimizer's micro-batches, not a GAN's
        stray, self._stray = self._stray, None
        if stray is not None:
            if pending is None and closure is None:  # nothing else: the loop's own after all
                pending, slot.micro = stray, self._stray_micro
            self._stray_micro = 0
        last = self._last_backward
        if last is not None:
            # Compared with the loss passed to probe.step() by storage only after several
            # micro-batches: then kept as a detached view, else dropped here (``_last_held``
            # still tells that very tensor passed back).
            self._last_backward = last.detach() if slot.micro > 1 else None
        # Accumulated micro-batches backpropagated before the step, plus the closure's own
        # (Lightning runs the last micro-batch's forward/backward inside step(closure)), each
        # kept as on_backward keeps them (a CPU loss's value, a device loss detached).
        slot.loss = (
            closure if pending is None else pending if closure is None else pending + closure
        )

    # --- taps (taps.Listener) ------------------------------------------------------------------
    def on_backward(self, loss: torch.Tensor, value: float | None = None) -> None:
        """A scalar about to be backpropagated (the tap calls this before the backward).
        ``value``: a CPU scalar's value, read by the tap: kept instead of the tensor (nothing
        to detach, and whether it is NaN or Inf is known without a sync); a device scalar is
        kept detached (float32 or wider). A sum is made only under gradient accumulation."""
        # The step's forward ends where its backward starts (the loss is part of it): the
        # last micro-batch's under accumulation, the closure's first evaluation's; not a
        # backward after the update began (another model's, trained after the step).
        phases = self.phases
        if phases is not None and (not phases.active or phases.updating):
            phases = None
        kept = value if value is not None else _as_loss(loss)
        # x - x is 0.0 for every finite float, NaN for NaN and +-Inf: no call (math.isfinite
        # is one, in the cold moment before the backward).
        nonfinite = value is not None and value - value != 0.0
        self._last_kept = kept
        for slot in self._slots:
            if slot.in_step:  # inside step(closure): LBFGS evaluates it again and again
                if phases is not None:
                    phases.forward_pending = False
                if slot.closure_loss is None:
                    if phases is not None:
                        phases.timeline.forward_end = self._mark()
                    slot.closure_loss = kept
                    slot.closure_nonfinite = nonfinite
                    self._micro += 1
                return
        if phases is not None:
            timeline = phases.timeline
            if phases.forward_pending or timeline.forward_start is not None:
                # A watched forward since the last backward (a loop may run it before
                # probe.step()) or in this step (several losses of one forward).
                phases.forward_pending = False
                self._forwards_seen = True
            elif self._forwards_seen:
                # No watched forward for it: kept aside, not summed into the step's loss.
                stray = self._stray_before = self._stray
                self._stray = kept if stray is None else stray + kept
                self._stray_micro += 1
                self._last_kept = _STRAY  # a failure of its backward takes it back
                if nonfinite:
                    # It may be the step's loss after all (no other): where a NaN began is
                    # still read before the update (at worst one pass more).
                    self._pending_nonfinite = True
                return
            if timeline.optimizer_start is None:
                timeline.forward_end = self._mark()
        if self._amp_skip:
            self._forget_amp_skip()  # a new iteration: that skip got no probe.step() of its own
        # The loop's own tensor, as the last scalar backpropagated until the update; a CPU
        # one also held until probe.step(): passed back as the step's loss, its value is known
        # already (an identity test; a weak reference would cost a tracked object per
        # backward). One the loop dropped before probe.step() is freed there, with its graph,
        # instead of after the update (after its backward the graph keeps only what
        # retain_graph, create_graph or a custom Function's ctx keep).
        self._last_backward = loss
        self._last_held = loss if value is not None else None
        self._last_value = value
        self._micro += 1
        if nonfinite:
            self._pending_nonfinite = True
        pending = self._pending_before = self._pending_loss
        # Async kernels on a device loss's device: no sync.
        self._pending_loss = kept if pending is None else pending + kept

    def on_backward_failed(self, loss: torch.Tensor) -> None:
        """The backward of ``loss``, counted by :meth:`on_backward` just before it, raised: it
        is taken back out of the update's loss and micro-batches (a loop that skips a batch
        whose backward ran out of memory goes on), exactly (the sum before it is restored, no
        arithmetic). Gradients it may have accumulated before failing stay, as torch leaves
        them. A NaN flag it set stays: at worst one extra gradient pass."""
        kept, self._last_kept = self._last_kept, None
        if kept is None:
            return
        if kept is _STRAY:
            self._stray, self._stray_before = self._stray_before, None
            self._stray_micro = max(0, self._stray_micro - 1)
            return
        for slot in self._slots:
            if slot.in_step:
                if slot.closure_loss is kept:
                    slot.closure_loss = None
                    self._micro = max(0, self._micro - 1)
                return
        self._micro = max(0, self._micro - 1)
        if self._last_backward is loss:
            self._last_backward = self._last_held = self._last_value = None
        self._pending_loss, self._pending_before = self._pending_before, None
        if self._pending_loss is None:
            self._pending_nonfinite = False

    def on_clip(self, parameters: list[Any], max_norm: float, total_norm: Any) -> None:
        if not parameters or self._clip is not None:
            return
        # Which watched parameter sets this clip covers, worked out once per list of
        # parameters: loops clip model.parameters() on every step, and a set of every
        # parameter's id there, right after the backward, cost a Python loop per step.
        key = tuple(map(id, parameters))  # built and compared in C: no Python loop
        covered = self._clip_covers
        if covered is None or covered[0] != key:
            ids = {id(p) for p in parameters}
            slots = [slot.key for slot in self._slots if ids & slot.grads.param_ids]
            covered = self._clip_covers = (
                key,
                slots,
                bool(self._rest and ids & self._rest.param_ids),
            )
        _, slots, covers_rest = covered
        mine = bool(slots)
        for slot_key in slots:
            # Before clip_grad_norm_ scales them: the norms users need to see explode.
            self.on_grads_ready(slot_key)
        rest = self._rest
        if rest is not None and covers_rest:
            mine = True
            if self._rest_sample is None and (self._sample_now or self._pending_nonfinite):
                forced = not self._sample_now
                self._forced = self._forced or forced
                sample = self._compute_grads(rest, weights=forced)  # unclipped, as above
                if sample is not None:  # checked before the loop's own update of them
                    sample, _ = self._check_host(rest, sample)
                self._rest_sample = sample
        if mine:
            self._clip = (_number(max_norm), total_norm)

    def on_scaler_update(self) -> None:
        """An AMP iteration ended. If GradScaler skipped the update (inf gradients at its
        scale: routine, the scaler lowers the scale and goes on), what was backpropagated for
        it fed no update: it is not part of the next step's loss, and what was read of its
        gradients (scaled, or unscaled and found inf by the scaler) describes no update. A
        ``probe.step()`` before the next backward records the iteration as skipped."""
        if not self._updated and self._slots:
            self.amp_skipped_steps += 1  # also under tdbg run, where it gets no step
            self._amp_skip = True
            self._amp_loss, self._pending_loss = self._pending_loss, None
            self._pending_nonfinite = False
            self._amp_micro, self._micro = self._micro, 0
            self._amp_forward, self._forward_origin = self._forward_origin, None
            for slot in self._slots:
                slot.sample = None
            self._rest_sample = self._clip = None
            self._changed_layers = None
            self._forced = False
        self._updated = False

    def _forget_amp_skip(self) -> None:
        self._amp_skip = False
        self._amp_loss = self._amp_forward = None
        self._amp_micro = 0

    def on_loader_iter(self, loader: Any) -> None:
        if self.epoch_given:
            return
        if self._loader is not None and self._loader() is loader:
            self.epoch = (0.0 if self.epoch != self.epoch else self.epoch) + 1.0
            self._iterating = None
            self._pass_batches = 0
            return
        # The dataset by id: a loader made inline (``for x in DataLoader(ds)``) is gone by the
        # first step; its dataset is the script's and stays.
        self.loader_started(weakref.ref(loader), id(getattr(loader, "dataset", None)))

    def loader_started(self, ref: Any, dataset: int) -> None:
        """A DataLoader pass started (its loader's weak reference, its dataset's id): seen by
        the tap, or begun before this probe existed (``tdbg run`` starts it at the first
        backward); the next step decides whether it is the training loader's."""
        if self.epoch_given:
            return
        self._iterating = (ref, dataset)
        self._steps_at_iter = self.step_count

    def _note_loader(self) -> None:
        """At a step, the DataLoader started since the last one: the first that steps follow is
        the training one (its passes are epochs); later, one reading the training dataset
        while the training loader is gone is a new DataLoader made for a new epoch. Others
        (validation, or a pass over the training data while its loader lives) are not."""
        started, self._iterating = self._iterating, None
        if started is None or self.epoch_given:
            return
        ref, dataset = started
        if self._loader is None:
            self._adopt(ref, dataset)
            self.epoch = 0.0
        elif dataset == self._dataset and (
            self._loader() is None
            or (self._pass_length is not None and self._pass_batches >= self._pass_length)
        ):
            self._adopt(ref, dataset)
            self.epoch = (0.0 if self.epoch != self.epoch else self.epoch) + 1.0

    def _adopt(self, ref: Any, dataset: int) -> None:
        """``ref``'s loader is the training one from now on; its pass starts now."""
        self._loader, self._dataset = ref, dataset
        self._pass_batches = 0
        loader = ref()
        try:
            self._pass_length = len(loader) if loader is not None else None
        except Exception:  # an IterableDataset without a length
            self._pass_length = None

    # --- the gradient pass ---------------------------------------------------------------------
    def _compute_grads(self, stats: GradientStats, weights: bool = False) -> GradSample | None:
        """One gradient pass. ``weights``: read the weights' norms too (a step already known
        to be non-finite). On the CPU they are otherwise read only when the pass finds a NaN
        or Inf (:meth:`_check_host`, no sync); on a device, where that check would need a sync,
        every pass reads them in its one fused call."""
        if not stats.n_params:
            return None
        t0 = perf()
        before = self._cuda_mark() if self._cuda_device is not None else None
        sample = stats.compute(weights or stats.device.type != "cpu")
        if self._cuda_device is None and self.grad_every != 1:
            # Steps in between go unmeasured: what tells, at the next pass, an update's NaN
            # from a weight set to NaN by other code (a memory read a parameter; CPU runs,
            # where a non-finite loss forces a pass).
            stats.note_versions()
        if before is not None:
            # Host time is only the launch cost on a GPU: the probe thread times the kernels
            # with these events and reports back (on_grad_device_time).
            after = self._cuda_mark()
            start = before if self._grad_marks is None else self._grad_marks[0]
            self._grad_marks = (start, after)
        self._grad_seconds += perf() - t0
        if stats.replanned:  # a replanning pass also built index tensors: not typical
            self._replanned = True
        return sample

    def _loss_parts(self, loss: Any) -> tuple[float | None, torch.Tensor | None]:
        """(python value, device tensor) of the loss; never syncs with the device."""
        if loss is None:
            return None, None
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                self.report_once(
                    "loss-shape",
                    f"probe.step(loss): the loss has shape {tuple(loss.shape)}; pass a scalar "
                    "(e.g. loss.mean()) — loss not recorded",
                )
                return None, None
            return None, loss.detach() if loss.requires_grad else loss
        value = _number(loss)
        if math.isnan(value) and not isinstance(loss, float):
            self.report_once(
                "loss-type", f"probe.step(loss): cannot read a number from {type(loss).__name__}"
            )
            return None, None
        return value, None

    def _count(self, value: Any, what: str) -> float:
        """samples= / tokens= as a float, without reading a device tensor (that would sync);
        anything that is not a count (a number >= 0) is reported once and not recorded."""
        if value is None:
            return NAN
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            self.report_once(
                f"{what}-device",
                f"probe.step({what}=...): a {value.device.type} tensor would need a host sync "
                "to read; pass a Python int — not recorded",
            )
            return NAN
        count = _number(value)
        if 0 <= count < INF:
            return count
        shown = repr(value) if type(value) in (int, float, str) else type(value).__name__
        self.report_once(
            f"{what}-value",
            f"probe.step({what}={shown[:40]}): not a count (a number, 0 or more) — not recorded",
        )
        return NAN

    def _take_samples(self, force_rest: bool = False, weights: bool = False) -> GradSample | None:
        """This step's gradient sample: each optimizer's, read now for one that did not read
        its own (an optimizer that did not step, manual updates), joined into one row.
        ``force_rest``: read the parameters no optimizer updates even if not due; ``weights``:
        read the weights too (a step known to be non-finite)."""
        weights = weights or self._forced
        samples: list[tuple[GradientStats, GradSample]] = []
        due = self._sample_now or self._forced
        for slot in self._slots:
            sample, slot.sample = slot.sample, None
            if sample is None and due:
                try:
                    sample = self._compute_grads(slot.grads, weights)
                except Exception as exc:  # a failed gradient pass must not cost the loss
                    self._count_error(exc)
                if sample is not None and len(sample.missing) >= len(slot.grads.layer_indices):
                    # The optimizer did not step and zero_grad already ran: no gradient at
                    # all is not "no gradient reached every layer".
                    sample = None
                if sample is not None:
                    sample, _ = self._check_host(slot.grads, sample)
            if sample is not None:
                samples.append((slot.grads, sample))
        rest_sample, self._rest_sample = self._rest_sample, None
        if rest_sample is None and self._rest is not None and (due or force_rest):
            try:
                rest_sample = self._compute_grads(self._rest, weights or force_rest)
                if rest_sample is not None:
                    rest_sample, _ = self._check_host(self._rest, rest_sample)
            except Exception as exc:
                self._count_error(exc)
        if rest_sample is not None and self._rest is not None:
            samples.append((self._rest, rest_sample))
        if not samples or not self._n_layers:
            return None
        if any(s.weights for _, s in samples) and not all(s.weights for _, s in samples):
            # One optimizer's pass found a NaN and read its weights: the others' too, so that
            # the step's row says which layers' weights were non-finite (a rare step).
            samples = [(stats, stats.with_weights(s)) for stats, s in samples]
        return GradSample.join([s for _, s in samples])

    def _step_losses(self, loss: Any) -> tuple[Any, dict[str, Any], int]:
        """The step's loss (what the loop passed, else what was backpropagated for the first
        optimizer's update, else since the last step), each optimizer's when several, and the
        micro-batches (scalars backpropagated) of the update whose loss it is."""
        per_optimizer: dict[str, Any] = {}
        first: Any = None
        micro = 0
        several = len(self._slots) > 1
        for slot in self._slots:
            value, count = slot.loss, slot.micro
            slot.loss, slot.micro = None, 0
            # Also after a step(closure) that raised (its post-hook never ran): the next
            # backwards are outside any step.
            slot.in_step = False
            if value is None:
                continue
            if first is None:
                first, micro = value, count
            if several:
                per_optimizer[f"loss/{slot.name}"] = _as_loss(value)
        leftover, self._pending_loss = self._pending_loss, None
        self._pending_nonfinite = False
        rest_micro, self._micro = self._micro, 0
        stray, self._stray = self._stray, None
        stray_micro, self._stray_micro = self._stray_micro, 0
        if first is None:
            first, micro = leftover, rest_micro
        if self._amp_skip and first is None:
            first, micro = self._amp_loss, self._amp_micro
        if first is None and stray is not None:
            first, micro = stray, stray_micro
        last, self._last_backward = self._last_backward, None
        last_value, self._last_value = self._last_value, None
        held = self._last_held  # released at the end of step(), after its timing
        self._last_kept = None
        if loss is None:
            loss = first
        elif micro > 1 and first is not None and _same_tensor(loss, last):
            # probe.step(loss) with the variable at hand after k micro-batches: the last one
            # (divided by k, as nanoGPT does) is not this update's loss; what was
            # backpropagated for the update is (their sum: the mean micro-batch loss).
            self.report_once(
                "loss-last-micro-batch",
                f"probe.step(loss): that loss is the last of the {micro} micro-batches "
                "backpropagated for this update; the step shows the update's loss, their sum "
                "(the mean micro-batch loss when each is divided by their number)",
            )
            loss = first
        elif last_value is not None and held is loss:
            loss = last_value  # the scalar just backpropagated, read before its backward
        return loss, per_optimizer, micro

    def sampled_this_step(self) -> bool:
        """Some of this step's gradients were read already (before its ``probe.step()``)."""
        return self._rest_sample is not None or any(s.sample is not None for s in self._slots)

    def _step_lrs(self) -> list[float]:
        lrs: list[float] = []
        for slot in self._slots:
            read, slot.lr = slot.lr, None
            lrs.extend(read if read is not None else self._learning_rates(slot.optimizer))
        if len(lrs) > MAX_LR_COLUMNS:
            self.report_once(
                "lr-columns",
                f"{len(lrs)} param groups: the learning rates of the first {MAX_LR_COLUMNS} "
                "are shown",
            )
            del lrs[MAX_LR_COLUMNS:]
        return lrs

    def step(self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks, t0: float) -> None:
        """One ``probe.step()``: hand the step to the probe thread, sample gradients if due.
        ``t0``: when the caller's ``probe.step()`` began (its clock: ``perf``), the start of
        the probe's cost and of the step's time."""
        if self._iterating is not None:
            self._note_loader()
        if not self._handoff.open:
            # Nobody can ever read what this step would record: keep nothing, compute nothing.
            self.step_count += 1
            self._sample_now = False
            if self._cuda_device is not None:  # no CUDA event for a step nobody reads
                self.use_marks(hooks, False)
            self.forget_step()
            hooks.take()
            hooks.seconds = 0.0
            taps.take_seconds()
            return
        # Start to start, so the step includes probe.step() itself (and a gradient pass in it).
        step_time = NAN if self._last_host is None else t0 - self._last_host
        self._last_host = t0
        slots = self._slots
        usual = hidden = False
        if (
            len(slots) == 1
            and self._cuda_device is None
            and not (self._sample_now or self._forced or self._amp_skip)
            and self._pending_loss is None
            and self._stray is None
            and self._clip is None
            and self._rest is None
            and self._forward_origin is None
            and self._skipped_layers is None
            and self._changed_layers is None
        ):
            # The usual step of a CPU run: one optimizer updated once, no gradient pass due or
            # forced, nothing rare to hand on, and its loss known as a number (what the update
            # backpropagated, the very scalar passed back, or a float passed). Its values go
            # to the probe thread as they are, which builds the step (pending.usual_step):
            # each Python function entered and each object touched here, right after the
            # update, costs microseconds (the loop's kernels have evicted them). Any other
            # step goes the whole way, which also checks what this one assumes.
            slot = slots[0]
            value = slot.loss  # None: no update since the last step (or its step() raised)
            micro = slot.micro
            if loss is not None and value is not None:
                if micro > 1 and type(loss) is not float:
                    # Maybe the last micro-batch's scalar (or a view of it), not the
                    # update's loss: the whole way tells them apart.
                    value = None
                elif loss is self._last_held and self._last_value is not None:
                    value = self._last_value  # the very scalar backpropagated, read before
                else:
                    value = loss
            lrs = slot.lr
            # A CPU scalar tensor without a graph (``loss.detach()``) is read on the probe
            # thread, as the whole way's is; one with a graph goes the whole way (detached
            # there). So do counts that are not plain ones, and a loss that is not a scalar:
            # what is reported of them says the step it came with.
            usual = (
                lrs is not None
                and len(lrs) <= MAX_LR_COLUMNS
                and hooks.timeline.optimizer_start is not None
                and (samples is None or (type(samples) in _PLAIN and 0 <= samples <= MAX_COUNT))
                and (tokens is None or (type(tokens) in _PLAIN and 0 <= tokens <= MAX_COUNT))
                and (
                    type(value) is float
                    or (
                        type(value) is _Tensor
                        and value.is_cpu
                        and not value.requires_grad
                        and value.numel() == 1
                    )
                )
            )
        # hooks.take(), written out: each function entered after the update costs microseconds.
        timeline = hooks.timeline
        hooks.timeline = StepTimeline()
        hooks.updating = False  # also after a step() that raised between the hooks
        if hooks._no_grad_ends and timeline.no_grad_start is None:
            hooks.drop_no_grad_ends()  # a step without an evaluation: its forwards' ends unmarked
        if usual:
            assert lrs is not None
            slot.loss = slot.lr = None
            slot.micro = 0
            slot.in_step = False
            # Also zero after a step(closure) that raised since the update (its backward
            # counted, its post-hook never ran), as the whole way's _step_losses does.
            self._micro = self._stray_micro = 0
            self._pending_nonfinite = False
            self._last_backward = self._last_kept = self._last_value = None
            previous_end = self._previous_end
            sample = end = None
        else:
            previous = self._previous_end
            if type(previous) is CudaMark:
                # The device has not finished the step before while the host is done with this
                # one: the host runs a step or more ahead (the GPU is the bottleneck), and its
                # work, the probe's with it, hides behind the device's. Asked, not waited for.
                hidden = not previous.event.query()
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
                weights_only = _host_nonfinite(loss)
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
                    and _host_nonfinite(loss)
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
                    if type(samples) in _PLAIN and 0 <= samples <= MAX_COUNT
                    else self._count(samples, "samples")
                )
            if tokens is not None:
                pending.tokens = (
                    float(tokens)
                    if type(tokens) in _PLAIN and 0 <= tokens <= MAX_COUNT
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
            if (
                sample is None
                and len(scalars) == 1
                and loss_tensor is not None
                and loss_tensor.is_cpu
            ):
                pending.host_scalars = scalars  # the usual CPU step: the loss, kept as it is
                end = None
            elif scalars or sample is not None:
                staged = perf()  # device values and a sampled step's norms: timed whole
                end = _stage_values(pending, sample, scalars, self._cuda_device)
                self._grad_seconds += perf() - staged
            else:
                end = None
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
        # outside any timer (budget.FIXED_UNTIMED). Work timed whole is counted as timed.
        # (A conditional, not max(): a builtin's first call here costs microseconds.)
        untimed = timed - self._grad_seconds
        fixed = untimed * _FIXED_SCALE if untimed > 0.0 else 0.0
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
        # steps without a gradient pass) plus, every k steps, what a step with one pays on top
        # of that: the pass and all that comes with it (its staging, its share of the fixed
        # work, the weights where a NaN was found), so that the model's cost is the one the
        # probe reports. (The pass's own time alone left out the rest: 1.2-1.3 % measured for
        # a 1 % budget on the cnn demo's paced steps.)
        if sample is None:
            self._fixed_cost = (
                probe_time
                if self._fixed_cost == 0.0
                else ((1 - EMA) * self._fixed_cost + EMA * probe_time)
            )
        elif not self._replanned:
            # A pass's host time, hidden or not: how much room the host has left behind the
            # device is not known, and passes as often as their device time alone allows could
            # make the host the bottleneck (then its work counts again, and the interval would
            # swing between the two).
            surplus = max(0.0, host_time - self._fixed_cost)
            cost = self._grad_cost
            self._grad_cost = surplus if cost == 0.0 else (1 - EMA) * cost + EMA * surplus
        self._replanned = False
        # The running averages the interval goes by, written out (this runs after the update,
        # where each function entered costs microseconds); the interval itself is worked out
        # when a pass may be due, after one, and every 8 steps (an interval that the costs
        # have since shortened takes effect within 8 steps).
        if sample is not None:
            self._last_sampled = self.step_count - 1
        if step_time == step_time and step_time > 0:
            ema = self._step_ema
            self._step_ema = step_time if ema == 0.0 else (1 - EMA) * ema + EMA * step_time
            # Every step's whole probe time, the gradient passes and what each step pays,
            # against the step's: the cost the budget is about, as the probe reports it.
            self._spent_probe = (1 - SPENT_EMA) * self._spent_probe + SPENT_EMA * probe_time
            self._spent_step = (1 - SPENT_EMA) * self._spent_step + SPENT_EMA * step_time
        since = self.step_count - self._last_sampled
        if self.grad_every is not None:
            self.grad_interval = self.grad_every
        elif since >= self.grad_interval or sample is not None or self.step_count % 8 == 0:
            step, grad, fixed_cost, spent = self.measured_costs()
            self.grad_interval = gradient_interval(
                step, grad, fixed_cost, self.overhead_budget, spent
            )
        self._sample_now = since >= self.grad_interval
        # To the probe thread: a bounded deque, never blocks (the oldest dropped when full).
        handoff = self._handoff
        if usual:
            handed: UsualStep = (
                self.step_count - 1,
                t0,
                value,
                micro,
                samples,
                tokens,
                lrs,
                step_time,
                timeline,
                previous_end,
                self.epoch,
                probe_time,
            )
            handoff.steps.append(handed)
        else:
            pending.probe_time = probe_time
            handoff.steps.append(pending)
        handoff.appended += 1
        # The last scalar backpropagated, released after the probe timed itself: where the
        # loop dropped it already, its graph is freed here, the loop's work, not the probe's.
        self._last_held = None
        if self._cuda_device is not None:
            self._plan_marks(hooks)
        # The step ends here, after all its work (else the rest would count as the next
        # step's wait for data).
        self._previous_end = end if end is not None else self._mark()

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

    def forget_step(self) -> None:
        """Drop what the probe holds of the step in progress (the loop's last scalar and its
        graph included): a step nobody can read, a ``probe.step()`` that failed, a probe
        closed or switched off."""
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
        self._forget_amp_skip()

    def on_grad_device_time(self, seconds: float) -> None:
        """From the probe thread: a resolved gradient pass's device time (one float store)."""
        if seconds == seconds and seconds > 0:
            cost = self._grad_device_cost
            self._grad_device_cost = seconds if cost == 0.0 else (1 - EMA) * cost + EMA * seconds

    def _learning_rates(self, optimizer: torch.optim.Optimizer) -> list[float]:
        out = []
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if type(lr) is float:  # nearly always: read at the step pre-hook, in a cold moment
                out.append(lr)
            elif isinstance(lr, torch.Tensor):
                # A tensor lr on the GPU (capturable optimizers) would need a sync to read.
                out.append(float(lr) if lr.device.type == "cpu" else NAN)
            else:
                out.append(_number(lr))
        return out

    def measured_costs(self) -> tuple[float, float, float, float]:
        """What the adaptive interval goes by (running averages, seconds): a step; what a step
        with a gradient pass costs the loop on top of one without (or the pass's device time,
        where larger); the probe's cost on a step without one; and the fraction of step time
        the probe spent over its recent steps (NaN until known)."""
        spent = self._spent_probe / self._spent_step if self._spent_step > 0 else NAN
        grad = max(self._grad_cost, self._grad_device_cost)
        return self._step_ema, grad, self._fixed_cost, spent


def _same_tensor(a: Any, b: Any) -> bool:
    """``a`` is the tensor ``b`` (or a view of it, as the backward tap keeps): same storage."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.numel() == 1
        and a.device == b.device
        and a.data_ptr() == b.data_ptr()
    )


def _stage_values(
    pending: PendingStep,
    sample: GradSample | None,
    scalars: dict[str, Any],
    cuda_device: torch.device | None,
) -> CudaMark | None:
    """Put the step's device values (loss, clip norm, per-optimizer losses, per-parameter
    norms) on their way to the host: CPU values are kept as they are (reading them later never
    syncs); device ones join the step's one copy. Returns the mark whose event tells the copy
    is done when it was recorded on ``cuda_device``: it also ends the step (the next step's
    data gap starts there), one event fewer a step."""
    values: list[torch.Tensor] = []
    device: torch.device | None = None
    grads = sample.values if sample is not None else None
    if not isinstance(grads, torch.Tensor):
        grads = None
    else:
        device = grads.device
    for name, value in scalars.items():
        if not isinstance(value, torch.Tensor) or value.is_cpu:
            if pending.host_scalars is None:
                pending.host_scalars = {}
            pending.host_scalars[name] = value
            continue
        if pending.device_scalars is None:
            pending.device_scalars = []
        pending.device_scalars.append(name)
        values.append(value)
    if grads is None and len(values) == 1 and not values[0].requires_grad:
        # The usual GPU step, the loss alone: copied as it is (one element, any shape and
        # float dtype); the probe thread flattens and converts it. Each op here is
        # microseconds of launch cost.
        vector = values[0]
    elif values or grads is not None:
        parts: list[torch.Tensor] = []
        for value in values:
            target = device or value.device
            device = target
            parts.append(value.detach().reshape(1).to(target, torch.float32, non_blocking=True))
        if grads is not None:
            parts.append(grads.float())
        vector = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        return None
    # The step's one device-to-host copy; the probe thread reads it once its event is done.
    pending.values, pending.ready = host_copy(vector, timing=True)
    if pending.ready is not None and vector.device == cuda_device:
        return CudaMark(perf(), pending.ready)
    return None
