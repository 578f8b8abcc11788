"""What was backpropagated for each update: the loss, micro-batches, strays, AMP's skipped ones."""

from __future__ import annotations

from typing import Any

import torch

from tdbg.probe.training.release import HELD
from tdbg.probe.training.sampler_state import SamplerState

_STRAY = object()  # on_backward's note that the latest backward was kept aside


def _as_loss(value: Any) -> Any:
    """A backpropagated scalar as a loss to add up or keep: a CPU loss's value as it is (a
    float, read by the backward tap), a device one detached, float32 or wider."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad:
        value = value.detach()
    return value if value.dtype == torch.float32 or value.dtype == torch.float64 else value.float()


class LossTally(SamplerState):
    """The backward tap's and the optimizer post-hook's bookkeeping of the step's loss."""

    __slots__ = ()

    def on_optimizer_post(self, key: int) -> None:
        slot = self._by_key.get(key)
        if slot is None:
            return
        slot.in_step = False
        self._updated = True
        if slot.measuring and slot.updates is not None:
            # The update is done: its layers' ratios (a sampled step only; timed whole).
            slot.measuring = False
            marks = self._grad_marks  # (a GPU run's: its pass's device time)
            if marks is None:
                slot.update_result, took = slot.updates.finish()
            else:
                # Its kernels, after the update: a span of the probe's device time of its own.
                before = self._cuda_mark()
                slot.update_result, took = slot.updates.finish()
                self._grad_marks = (*marks, before, self._cuda_mark())
            self._grad_seconds += took
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
            HELD.append(last)  # its graph freed once the hook's timer stopped
        # Accumulated micro-batches backpropagated before the step, plus the closure's own
        # (Lightning runs the last micro-batch's forward/backward inside step(closure)), each
        # kept as on_backward keeps them (a CPU loss's value, a device loss detached).
        slot.loss = (
            closure if pending is None else pending if closure is None else pending + closure
        )

    # --- taps (taps.Listener) ------------------------------------------------------------------
    def on_backward(
        self, loss: torch.Tensor, value: float | None = None, at: float | None = None
    ) -> None:
        """A scalar about to be backpropagated (the tap calls this before the backward).
        ``value``: a CPU scalar's value, read by the tap: kept instead of the tensor (nothing
        to detach, and whether it is NaN or Inf is known without a sync); a device scalar is
        kept detached (float32 or wider). A sum is made only under gradient accumulation.
        ``at``: the clock when the backward began, where read already (a lean step replayed,
        lean.py); else read here."""
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
                timeline.forward_end = self._mark() if at is None else at
        if self._amp_skip:
            self._forget_amp_skip()  # a new iteration: that skip got no probe.step() of its own
        # The loop's own tensor, as the last scalar backpropagated until the update; a CPU
        # one also held until probe.step(): passed back as the step's loss, its value is known
        # already (an identity test; a weak reference would cost a tracked object per
        # backward). One the loop dropped before probe.step() is freed there, with its graph,
        # instead of after the update (after its backward the graph keeps only what
        # retain_graph, create_graph or a custom Function's ctx keep).
        previous, previous_held = self._last_backward, self._last_held
        self._last_backward = loss
        self._last_held = loss if value is not None else None
        if previous is not None or previous_held is not None:
            HELD.append((previous, previous_held))  # freed once the tap's timer stopped
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
            self._drop_updates()  # no update happened: nothing moved
            self._rest_sample = self._clip = None
            self._changed_layers = None
            self._forced = False
        self._updated = False

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


def _same_tensor(a: Any, b: Any) -> bool:
    """``a`` is the tensor ``b`` (or a view of it, as the backward tap keeps): same storage."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.numel() == 1
        and a.device == b.device
        and a.data_ptr() == b.data_ptr()
    )
