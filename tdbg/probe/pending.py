"""A step handed from the training thread to the probe thread, resolved once its copy is done."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from tdbg.probe.gradients import GradSample
from tdbg.probe.hooks import Mark, StepTimeline, span
from tdbg.protocol.steps import NAN, StepRecord


@dataclass
class PendingStep:
    """What ``probe.step()`` knew, with device values still in flight.

    ``values`` is a host tensor laid out as ``[loss?] + [layer_0, layer_1, ...]`` (the loss first
    only when ``loss_in_values``); on CUDA it is the target of one non-blocking copy and ``ready``
    is the event recorded after it. The probe thread reads it only once ``ready.query()``.
    """

    step: int
    time: float
    lr: list[float]
    step_time: float
    samples: float
    tokens: float
    probe_time: float
    timeline: StepTimeline
    previous_end: Mark | None
    step_mark: Mark
    loss: float | None = None
    loss_tensor: Any = None
    loss_in_values: bool = False
    values: Any = None
    ready: Any = None
    grads: GradSample | None = None  # this step's sample, when gradients were sampled
    missing_layers: list[int] = field(default_factory=list)
    grad_marks: tuple[Mark, Mark] | None = None  # around the gradient pass, on a GPU
    grad_device_time: float | None = None  # what the pass took on the device, once resolved

    def resolve(self) -> tuple[StepRecord, list[int]] | None:
        """The finished record, or None while device work is pending. Never blocks."""
        if self.ready is not None and not self.ready.query():
            return None
        tl = self.timeline
        fwd_start, fwd_end = tl.forward_start, tl.forward_end
        opt_start, opt_end = tl.optimizer_start, tl.optimizer_end
        backward_end = opt_start if opt_start is not None else self.step_mark
        spans = (
            span(fwd_start, fwd_end),
            span(fwd_end, backward_end),
            span(opt_start, opt_end),
        )
        if any(s is None for s in spans):
            return None
        forward, backward, optimizer = (NAN if s is None else s for s in spans)
        if self.grad_marks is not None:
            grad_time = span(*self.grad_marks)
            if grad_time is None:
                return None
            self.grad_device_time = grad_time
        # On a GPU this is device idle time between the steps (the events' gap): a host stuck
        # in a blocking copy while the GPU is still busy is not waiting for data.
        data = span(self.previous_end, fwd_start)
        if data is None:
            return None
        data = max(0.0, data) if data == data else NAN
        loss = self.loss
        grad_total: float | None = None
        grad_norms: array | None = None
        host = self.values
        if host is not None and self.loss_in_values:
            loss, host = float(host[0]), host[1:]
        if self.grads is not None:
            grad_norms, grad_total = self.grads.layer_norms(None if self.grads.on_host else host)
        if self.loss_tensor is not None:
            loss = float(self.loss_tensor)  # a CPU tensor: already computed, no sync
        record = StepRecord(
            step=self.step,
            time=self.time,
            loss=loss,
            lr=self.lr,
            step_time=self.step_time,
            samples=self.samples,
            tokens=self.tokens,
            data_time=data,
            forward_time=forward,
            backward_time=backward,
            optimizer_time=optimizer,
            probe_time=self.probe_time,
            grad_total=grad_total,
            grad_norms=grad_norms,
        )
        return record, self.missing_layers
