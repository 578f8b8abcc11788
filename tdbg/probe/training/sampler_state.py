"""What the probe's training side knows between its hooks and probe.step(): one object's state."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tdbg.probe.alerts import alert
from tdbg.probe.log import warn
from tdbg.probe.training import taps
from tdbg.probe.training.gradients import GradientStats, GradSample, Layer
from tdbg.probe.training.guard import NonfiniteGuard
from tdbg.probe.training.histograms import HistogramPart, LayerHistograms
from tdbg.probe.training.hooks import Mark, PhaseHooks, marker
from tdbg.probe.training.inbox import Inbox
from tdbg.probe.training.lean import LeanStep
from tdbg.probe.training.loss_ring import LossRing
from tdbg.probe.training.pending import SkippedUpdate
from tdbg.probe.training.self_timing import TIMED
from tdbg.probe.training.update_ratio import UpdateRatios

NAN = float("nan")
REPORTS_PER_KIND = 3  # report_once: distinct reports of one kind of problem before a count
FOLDED = {  # report_once: what the count of one kind says
    "metric-type": "tdbg.log values that are not numbers",
    "metric-shape": "tdbg.log tensors that are not one number",
    "metric-complex": "complex tdbg.log values",
    "metric-overflow": "tdbg.log ints past a float's range",
    "metric-name": "tdbg.log names that are not strings",
}


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
    updates: UpdateRatios | None = None  # its layers' update ratios, on sampled steps
    measuring: bool = False  # a copy of its weights was taken for this update (sampled)
    # The update ratios of this step's update: (layers, ratios on the weights' device).
    update_result: tuple[list[int], torch.Tensor] | None = None
    histograms: LayerHistograms | None = None  # its layers' histograms, on sampled steps
    histogram_result: HistogramPart | None = None  # this step's, before its update


class SamplerState:
    """The state the sampler's parts share: one object's slots, set up in one place.

    The parts (loss_tally, grad_passes, epochs, cost_model, step_values) are mixins over it,
    each with one job; :class:`tdbg.probe.training.sampler.StepSampler` is all of them."""

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
        "_costs_through",
        "_folded",
        "_forced",
        "_forwards_seen",
        "_forward_origin",
        "_grad_cost",
        "_grad_device_cost",
        "_grad_marks",
        "_grad_seconds",
        "_hook_average",
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
        "_hidden",
        "_loss_ring",
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
        "lean",
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
        # The running average of what the hooks and taps timed of themselves on a usual step
        # (0 until one is): what a step whose fixed work is not timed is counted at. The first
        # steps time themselves (self_timing), whatever a probe before this one left.
        self._hook_average = 0.0
        TIMED[0] = True
        # What the hooks and taps write while a step is lean (lean.py), and replay it into
        # this state when it is not (settle).
        self.lean = LeanStep(self.settle)
        self._fixed_cost = 0.0  # EMA of the probe's cost on a step without a gradient pass
        self._costs_through = -1  # the last step counted into these running averages
        self._replanned = False  # this step's pass also planned the layout (not typical)
        self._previous_end: Mark | None = None
        # Whether the host ran ahead of the device when last asked (a step ending in a CUDA
        # event: the timed ones); the steps between are taken to be as that one was.
        self._hidden = False
        # A GPU run's usual steps' losses, read back a tick later in one copy (loss_ring.py);
        # None on the CPU, and for good once a copy into it or out of it failed.
        self._loss_ring = LossRing(cuda_device) if cuda_device is not None else None
        handoff.ring = self._loss_ring  # the probe thread frees its slots (LossRing.reclaim)
        self.lean.device_loss = cuda_device
        self._grad_marks: tuple[Mark, ...] | None = None  # (start, end) pairs: pending.py
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

    def settle(self) -> None:
        """A lean step's readings into this state (StepSampler's; lean.py)."""

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

    def _drop_updates(self) -> None:
        """No update ratios (nor histograms) for this step: a copy whose update did not come
        (a skipped AMP step, a step() that raised, a step nobody reads) is freed."""
        for slot in self._slots:
            if slot.measuring and slot.updates is not None:
                slot.updates.drop()
            slot.measuring = False
            slot.update_result = None
            slot.histogram_result = None

    def _forget_amp_skip(self) -> None:
        self._amp_skip = False
        self._amp_loss = self._amp_forward = None
        self._amp_micro = 0
