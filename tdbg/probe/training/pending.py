"""A step handed from the training thread to the probe thread, resolved once its copy is done."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from typing import Any, cast

from tdbg.probe.training import budget
from tdbg.probe.training.gradients import GradSample
from tdbg.probe.training.histograms import HistogramPart
from tdbg.probe.training.hooks import Mark, StepTimeline, host_time, perf, span
from tdbg.probe.training.loss_ring import LossBatch
from tdbg.protocol.steps import NAN, StepRecord

# The usual step of a CPU run as the training thread hands it over (StepSampler.step), its
# values as they are, read and stored, nothing worked out: (step, probe.step()'s start on the
# perf clock, loss (a number, or a CPU scalar tensor without a graph), micro-batches, samples=
# and tokens= (None or plain counts), learning rates, the step before's start (None: none),
# timeline, previous step's end, epoch, probe.step()'s end, the hooks' and taps' seconds since
# the last step, the seconds of that work timed whole). The probe thread works out the step's
# time and probe time from them (budget.probe_seconds) and makes the record (usual_record): the work
# the training thread is spared.
UsualStep = tuple[
    int,
    float,
    Any,
    int,
    Any,
    Any,
    list[float],
    float | None,
    StepTimeline,
    Mark | None,
    float,
    float,
    float,
    float,
]


# A lean step (lean.py) as the training thread hands it over: (step, probe.step()'s start,
# loss, samples=, tokens=, learning rates, the step before's start, forward start, backward
# start, optimizer start and end, the previous step's end, epoch, probe.step()'s end, the
# hooks' and taps' seconds). One micro-batch, no work timed whole, no no-grad phase: the probe
# thread makes it a UsualStep (as_usual).
LeanHanded = tuple[
    int, float, Any, Any, Any, list[float], float | None, float | None, float | None,
    float | None, float | None, Mark | None, float, float, float,
]  # fmt: skip


LEAN_LENGTH = 15  # a LeanHanded's (a UsualStep has 14)


def as_usual(raw: UsualStep | LeanHanded) -> UsualStep:
    """A usual step handed over either way, as a UsualStep (on the probe thread)."""
    if len(raw) != LEAN_LENGTH:
        return cast(UsualStep, raw)
    (step, started, loss, samples, tokens, lrs, last_start, forward_start, forward_end,
     opt_start, opt_end, previous_end, epoch, ended, hooks) = cast(LeanHanded, raw)  # fmt: skip
    timeline = StepTimeline()
    timeline.forward_start = forward_start
    timeline.forward_end = forward_end
    timeline.optimizer_start = opt_start
    timeline.optimizer_end = opt_end
    return (step, started, loss, 1, samples, tokens, lrs, last_start, timeline, previous_end,
            epoch, ended, hooks, 0.0)  # fmt: skip


class SkippedUpdate(list[int]):
    """The layers whose non-finite gradients made ``watch(skip_nonfinite=True)`` skip an
    update, and ``so_far``: the updates skipped up to and including this one, counted when it
    was skipped (the probe thread may resolve many steps at once: read later, the count would
    be theirs)."""

    __slots__ = ("so_far",)

    def __init__(self, so_far: int) -> None:
        super().__init__()
        self.so_far = so_far


class PendingStep:
    """What ``probe.step()`` knew, with device values still in flight.

    One is made per training step, on the training thread, right after the update, where its
    caches are cold: every field has its default on the class and there is no ``__init__``
    (a Python frame there, and a store into each of the 29 fields, cost microseconds); the
    sampler sets the fields the step has.

    ``values`` is a host tensor laid out as ``[scalars named by device_scalars] + [per-parameter
    norms]`` (float32), or the loss alone as it was (one element, any shape and float dtype:
    flattened here); on CUDA it is the target of one non-blocking copy and ``ready`` is the event
    recorded after it. The probe thread reads it only once ``ready.query()``. ``host_scalars``
    are CPU tensors (already computed: reading them never syncs) or numbers. A scalar is
    ``loss``, ``clip_norm`` or ``loss/NAME`` (one optimizer's loss, sent as a metric).
    """

    step: int = 0
    time: float = NAN  # the wall clock (time.time()) at probe.step()
    lr: Sequence[float] = ()
    step_time: float = NAN
    samples: float = NAN
    tokens: float = NAN
    probe_time: float = NAN
    timeline: StepTimeline = StepTimeline()  # read-only here: a step sets its own
    # The update ratios measured at this step: the layers, and the ratios as a CPU tensor or
    # (``update_count`` of them) at the end of the device copy ``values``; resolved into
    # ``update_values`` on the probe thread.
    update_layers: list[int] | None = None
    update_ratios: Any = None
    update_count: int = 0
    update_values: list[float] | None = None
    # The histograms counted at this step: what they cover, their values a CPU tensor there or
    # (``histogram_count`` of them) at the very end of ``values``; read on the probe thread into
    # ``histogram_values``.
    histograms: HistogramPart | None = None
    histogram_count: int = 0
    histogram_values: list[float] | None = None
    # A usual GPU step's loss, kept on the device in this batch at this place and read back
    # with the batch's others (loss_ring.py); None: the loss is in ``values`` or on the host.
    loss_batch: LossBatch | None = None
    loss_index: int = 0
    # A GPU step whose phases were not timed (only one in a few short steps is: each CUDA
    # event costs microseconds of host time): its phase columns are NaN, its marks host times.
    unmarked: bool = False
    previous_end: Mark | None = None
    step_mark: Mark | None = None  # made only where no optimizer hook marked the backward's end
    loss: float | None = None
    micro_batches: float = NAN
    clip_max: float = NAN
    epoch: float = NAN
    # Filled only on steps that have them: no empty containers made per step.
    host_scalars: dict[str, Any] | None = None
    device_scalars: list[str] | None = None
    points: tuple[tuple[int, str, float], ...] = ()  # metrics (loss/NAME), once resolved
    values: Any = None
    ready: Any = None
    grads: GradSample | None = None  # this step's sample, when gradients were sampled
    missing_layers: Sequence[int] = ()
    # On a GPU: (start, end) pairs around the probe's device work of a sampled step (the
    # gradient pass with the weight copy and histograms that follow it; the update ratios'
    # measurement after the update).
    grad_marks: tuple[Mark, ...] | None = None
    grad_device_time: float | None = None  # what the pass took on the device, once resolved
    weight_nonfinite: list[int] | None = None  # layers with NaN/Inf weights (sampled steps)
    forward_origin: tuple[str, str, int] | None = None  # a non-finite forward, re-run in place
    skipped_layers: SkippedUpdate | None = None  # skip_nonfinite: the update was skipped
    # Layers whose weights code other than the optimizer changed since the last pass (noted
    # on a pass that found a NaN or Inf; None: not known). See GradientStats.changed_layers.
    changed_layers: list[int] | None = None
    amp_skipped: bool = False  # GradScaler skipped this iteration's update
    weights_only: bool = False  # ``grads`` is read for its weights only (AMP skip: scaled)

    def _phases(self) -> tuple[float, float, float, float, float] | None:
        """(data, no-grad, forward, backward, optimizer) seconds from the step's marks (NaN: not
        marked), or None while one of their CUDA events is still pending. The gap from the
        step before's end to this step's forward is data, less the no-grad phase in it (a
        watched model's forwards without grad: an evaluation), so the two add up to the gap."""
        tl = self.timeline
        fwd_start, fwd_end = tl.forward_start, tl.forward_end
        opt_start, opt_end = tl.optimizer_start, tl.optimizer_end
        backward_end = opt_start if opt_start is not None else self.step_mark
        spans = (
            span(fwd_start, fwd_end),
            span(fwd_end, backward_end),
            span(opt_start, opt_end),
            # On a GPU this is device idle time between the steps (the events' gap): a host
            # stuck in a blocking copy while the GPU is still busy is not waiting for data.
            span(self.previous_end, fwd_start),
        )
        forward, backward, optimizer, gap = spans
        if forward is None or backward is None or optimizer is None or gap is None:
            return None
        # On a timed GPU step the gap is the device's idle time and the no-grad phase the
        # host's (an evaluation reads its results: the host waits for the device there): data
        # is what is left of the gap, at least 0, so a host running ahead (its fetch hidden
        # behind the device) is not taken for a wait on data.
        no_grad = self._no_grad_time()
        data = gap - no_grad if gap == gap and no_grad == no_grad else gap
        return (max(0.0, data) if data == data else NAN), no_grad, forward, backward, optimizer

    def _no_grad_time(self) -> float:
        """From the first forward without grad to the end of the last (host clock: an
        evaluation reads its results, so the host waits for the device there too); to the
        step's forward when no end was seen; 0 when none ran; NaN where nothing says."""
        tl = self.timeline
        start, end = tl.no_grad_start, tl.no_grad_end
        if start is None:
            return 0.0 if tl.forward_start is not None else NAN
        if end is None:
            if tl.forward_start is None:
                return NAN
            end = host_time(tl.forward_start)
        return max(0.0, end - start)

    def resolve(self) -> tuple[StepRecord, Sequence[int]] | None:
        """The finished record, or None while device work is pending. Never blocks."""
        if self.ready is not None and not self.ready.query():
            return None
        batch = self.loss_batch
        if batch is not None:
            losses = batch.read()  # the first step of a batch to come here starts its copy
            if losses is None:
                return None
            self.loss = losses[self.loss_index]
        phases = (NAN, NAN, NAN, NAN, NAN) if self.unmarked else self._phases()
        if phases is None:
            return None
        data, no_grad, forward, backward, optimizer = phases
        marks = self.grad_marks
        if marks is not None:
            grad_time = 0.0
            for k in range(0, len(marks) - 1, 2):
                part = span(marks[k], marks[k + 1])
                if part is None:
                    return None
                grad_time += part
            self.grad_device_time = grad_time
        grad_total: float | None = None
        grad_norms: array | None = None
        # The loss alone is copied as it is, in its own shape and dtype (see stage_values).
        host = None if self.values is None else self.values.reshape(-1).float()
        if self.histograms is not None:
            if self.histogram_count and host is not None:
                self.histogram_values = host[-self.histogram_count :].tolist()
                host = host[: -self.histogram_count]
            else:
                self.histogram_values = self.histograms.values.reshape(-1).float().tolist()
        if self.update_layers is not None:
            if self.update_count and host is not None:
                self.update_values = host[-self.update_count :].tolist()
                host = host[: -self.update_count]
            elif self.update_ratios is not None:
                self.update_values = self.update_ratios.reshape(-1).float().tolist()
        scalars = {name: float(value) for name, value in (self.host_scalars or {}).items()}
        if host is not None and self.device_scalars:
            k = len(self.device_scalars)
            scalars.update(zip(self.device_scalars, host[:k].tolist(), strict=True))
            host = host[k:]
        if self.grads is not None:
            on_device = None if self.grads.on_host else host
            if not self.weights_only:
                grad_norms, grad_total = self.grads.layer_norms(on_device)
            if self.grads.weights:  # else nothing was measured: not "finite weights"
                self.weight_nonfinite = self.grads.weight_nonfinite(on_device)
        loss = scalars.pop("loss", self.loss)
        clip_norm = scalars.pop("clip_norm", NAN)
        if scalars:
            self.points = tuple((self.step, name, value) for name, value in scalars.items())
        record = StepRecord(
            step=self.step,
            time=self.time,
            loss=loss,
            lr=list(self.lr),
            step_time=self.step_time,
            samples=self.samples,
            tokens=self.tokens,
            data_time=data,
            no_grad_time=no_grad,
            forward_time=forward,
            backward_time=backward,
            optimizer_time=optimizer,
            probe_time=self.probe_time,
            micro_batches=self.micro_batches,
            clip_max=self.clip_max,
            clip_norm=clip_norm,
            epoch=self.epoch,
            grad_total=grad_total,
            grad_norms=grad_norms,
        )
        return record, self.missing_layers


# What a usual step carries besides its record: nothing (every extra at its class default).
# Shared, read-only: the probe thread's per-step loop reads the same fields of every step.
USUAL_EXTRAS = PendingStep()


def usual_ready(handed: UsualStep | LeanHanded) -> bool:
    """Whether a usual step's record can be made now: always, but for a GPU lean step's
    loss, which is ready once its batch is back from the device (its first call here starts
    the batch's copy; loss_ring.py). Never blocks."""
    loss = handed[2]
    return type(loss) is not tuple or loss[0].read() is not None


def _loss_value(loss: Any) -> float | None:
    """A usual step's loss as handed over, not a float: a CPU scalar tensor (read: a memory
    load), a GPU lean step's place in the loss ring (read back: see usual_ready), or None."""
    if loss is None:
        return None
    if type(loss) is tuple:
        batch, index = loss
        losses = batch.read()
        return None if losses is None else losses[index]
    return float(loss)


def usual_record(handed: UsualStep | LeanHanded) -> StepRecord:
    """The finished record of a usual CPU step handed over as it was (on the probe thread),
    without a PendingStep: its marks are host clock readings, nothing is in flight. The same
    figures as ``PendingStep.resolve`` (tests/probe/test_usual_record.py holds them equal),
    written out (no call per phase): this is the probe thread's per-step work on short steps,
    where it competes with the loop for the GIL."""
    (step, started, loss, micro, samples, tokens, lrs, last_start, timeline, previous_end, epoch,
     ended, hooks, whole) = as_usual(handed)  # fmt: skip
    step_time = NAN if last_start is None else started - last_start
    scale = budget.LEAN_SCALE if len(handed) == LEAN_LENGTH else budget.FIXED_SCALE
    probe_time = budget.probe_seconds((ended - started) + hooks, whole, scale)
    # CPU marks: floats (a usual step is a CPU run's), None where not seen.
    fwd_start: Any = timeline.forward_start
    fwd_end: Any = timeline.forward_end
    opt_start: Any = timeline.optimizer_start
    opt_end: Any = timeline.optimizer_end
    gap = NAN if previous_end is None or fwd_start is None else fwd_start - previous_end
    start = timeline.no_grad_start
    if start is None:
        no_grad = NAN if fwd_start is None else 0.0
    else:
        end = timeline.no_grad_end
        if end is None:
            end = fwd_start
        no_grad = NAN if end is None else max(0.0, end - start)
    data = gap - no_grad if gap == gap and no_grad == no_grad else gap
    return StepRecord(
        step,
        # The wall clock at probe.step(): now, less the time since it began (one clock for both).
        time.time() - (perf() - started),
        loss if type(loss) is float else _loss_value(loss),
        list(lrs),
        step_time,
        NAN if samples is None else float(samples),
        NAN if tokens is None else float(tokens),
        (max(0.0, data) if data == data else NAN),
        no_grad,
        NAN if fwd_start is None or fwd_end is None else fwd_end - fwd_start,
        NAN if fwd_end is None or opt_start is None else opt_start - fwd_end,
        NAN if opt_start is None or opt_end is None else opt_end - opt_start,
        probe_time,
        float(micro) if micro else NAN,
        NAN,  # clip_max: a step with a clip is not a usual one
        NAN,  # clip_norm
        epoch,
    )


def usual_step(handed: UsualStep | LeanHanded) -> PendingStep:
    """The PendingStep of a usual step handed over as it was (on the probe thread)."""
    (step, started, loss, micro, samples, tokens, lrs, last_start, timeline, previous_end, epoch,
     ended, hooks, whole) = as_usual(handed)  # fmt: skip
    step_time = NAN if last_start is None else started - last_start
    scale = budget.LEAN_SCALE if len(handed) == LEAN_LENGTH else budget.FIXED_SCALE
    probe_time = budget.probe_seconds((ended - started) + hooks, whole, scale)
    pending = PendingStep()
    pending.step = step
    # The wall clock at probe.step(): now, less the time since it began (one clock for both).
    pending.time = time.time() - (perf() - started)
    pending.lr = lrs
    pending.step_time = step_time
    if samples is not None:
        pending.samples = float(samples)
    if tokens is not None:
        pending.tokens = float(tokens)
    pending.timeline = timeline
    pending.previous_end = previous_end
    if type(loss) is float:
        pending.loss = loss
    elif type(loss) is tuple:  # a GPU lean step's place in the loss ring
        pending.loss_batch, pending.loss_index = loss
        pending.unmarked = True
    elif loss is not None:
        pending.host_scalars = {"loss": loss}  # a CPU scalar: read when resolved
    if micro:
        pending.micro_batches = float(micro)
    pending.epoch = epoch
    pending.probe_time = probe_time
    return pending
