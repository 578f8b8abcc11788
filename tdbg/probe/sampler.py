"""The probe's per-step work on the training thread: loss, LR, the gradient pass, its cost."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from tdbg.probe.alerts import alert
from tdbg.probe.budget import gradient_interval
from tdbg.probe.gradients import GradientStats, GradSample, Layer
from tdbg.probe.hooks import Mark, PhaseHooks, mark, perf
from tdbg.probe.log import warn
from tdbg.probe.pending import PendingStep
from tdbg.probe.server import ProbeServer

NAN = float("nan")
EMA = 0.1  # weight of the newest value in the running averages of step time and costs


def _number(value: Any) -> float:
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError):
        return NAN


class StepSampler:
    """Everything ``probe.step()`` and the optimizer hook do on the training thread.

    Per step: the loss (never read from the device here), the learning rates, the step's
    timeline, and — every ``grad_interval`` steps, chosen to stay within ``overhead_budget``
    unless ``grad_every`` fixes it — one fused gradient pass; the step goes to the probe
    thread's inbox with its one device-to-host copy in flight. O(1) Python, no sync.
    """

    def __init__(
        self,
        layers: list[Layer],
        optimizer: torch.optim.Optimizer | None,
        cuda_device: torch.device | None,
        server: ProbeServer,
        *,
        grad_every: int | None,
        overhead_budget: float,
        count_error: Callable[[BaseException], None],
    ) -> None:
        self._grads = GradientStats(layers)
        self._optimizer = optimizer
        self._cuda_device = cuda_device
        self._server = server
        self._count_error = count_error
        self.grad_every = grad_every
        self.overhead_budget = overhead_budget
        self._n_trainable = sum(1 for layer in layers if layer.trainable)
        self.step_count = 0
        self._sample_now = True
        self._last_sampled = -1
        self.grad_interval = grad_every or 1
        self._grad_cost = 0.0  # EMA of seconds per gradient pass
        self._step_ema = 0.0  # EMA of seconds per step
        self._sample: GradSample | None = None
        self._grad_seconds = 0.0  # this step's gradient pass
        self._fixed_cost = 0.0  # EMA of the probe's per-step cost besides gradient passes
        self._previous_end: Mark | None = None
        self._grad_marks: tuple[Mark, Mark] | None = None
        self._grad_device_cost = 0.0  # EMA of the gradient pass's device time (GPU runs)
        self._last_host: float | None = None
        self._reported: set[str] = set()

    def report_once(self, key: str, message: str) -> None:
        """Tell the user once (stderr and an alert) about a problem with what the loop passes."""
        if key in self._reported:
            return
        self._reported.add(key)
        warn(f"tdbg: {message}")
        self._server.side_alerts.append(alert("probe_error", "warning", self.step_count, message))

    def on_optimizer_step(self) -> None:
        if self._sample_now and self._sample is None:
            self._compute_grads()

    def _compute_grads(self) -> None:
        if not self._grads.n_layers:
            return
        t0 = perf()
        before = mark(self._cuda_device) if self._cuda_device is not None else None
        self._sample = self._grads.compute()
        if before is not None:
            # Host time is only the launch cost on a GPU: the probe thread times the kernels
            # with these events and reports back (on_grad_device_time).
            self._grad_marks = (before, mark(self._cuda_device))
        cost = perf() - t0
        self._grad_seconds += cost
        if self._grads.replanned:
            return  # that pass also built index tensors: not what a pass usually costs
        self._grad_cost = (
            cost if self._grad_cost == 0.0 else (1 - EMA) * self._grad_cost + EMA * cost
        )

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
            return None, loss.detach()
        value = _number(loss)
        if math.isnan(value) and not isinstance(loss, float):
            self.report_once(
                "loss-type", f"probe.step(loss): cannot read a number from {type(loss).__name__}"
            )
            return None, None
        return value, None

    def _count(self, value: Any, what: str) -> float:
        """samples= / tokens= as a float, without reading a device tensor (that would sync)."""
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            self.report_once(
                f"{what}-device",
                f"probe.step({what}=...): a {value.device.type} tensor would need a host sync "
                "to read; pass a Python int — not recorded",
            )
            return NAN
        return _number(value)

    def step(self, loss: Any, samples: Any, tokens: Any, hooks: PhaseHooks) -> None:
        """One ``probe.step()``: hand the step to the probe thread, sample gradients if due."""
        t0 = perf()
        if not self._server.serving:
            # Nobody can ever read what this step would record: keep nothing, compute nothing.
            self.step_count += 1
            self._sample_now = False
            hooks.take()
            return
        step_mark = mark(self._cuda_device)
        # Start to start, so the step includes probe.step() itself (and a gradient pass in it).
        step_time = NAN if self._last_host is None else t0 - self._last_host
        self._last_host = t0
        if self._sample_now and self._sample is None and self._grads.n_layers:
            try:
                self._compute_grads()
            except Exception as exc:  # a failed gradient pass must not cost the step's loss
                self._count_error(exc)
            fallback = self._sample
            if (
                self._optimizer is not None
                and fallback is not None
                and not self._sample_seen(fallback)
            ):
                # The optimizer did not step (GradScaler skipped it) and zero_grad already ran:
                # no gradient at all is not "no gradient reached every layer".
                self._sample = None
        sample, self._sample = self._sample, None
        loss_value, loss_tensor = self._loss_parts(loss)
        pending = PendingStep(
            step=self.step_count,
            time=time.time(),
            lr=self._learning_rates(),
            step_time=step_time,
            samples=self._count(samples, "samples"),
            tokens=self._count(tokens, "tokens"),
            probe_time=NAN,
            timeline=hooks.take(),
            previous_end=self._previous_end,
            step_mark=step_mark,
            loss=loss_value,
        )
        pending.grad_marks, self._grad_marks = self._grad_marks, None
        if sample is not None:
            pending.grads = sample
            pending.missing_layers = sample.missing
        _stage_values(pending, sample, loss_tensor)
        self.step_count += 1
        # The gradient pass is counted once: in this call or in the optimizer hook that ran it.
        probe_time = (perf() - t0) + hooks.take_seconds()
        pending.probe_time = probe_time
        fixed = max(0.0, probe_time - self._grad_seconds)
        self._grad_seconds = 0.0
        self._fixed_cost = (
            fixed if self._fixed_cost == 0.0 else ((1 - EMA) * self._fixed_cost + EMA * fixed)
        )
        self._update_interval(step_time, sample is not None)
        self._server.push_step(pending)
        self._previous_end = mark(self._cuda_device)

    def on_grad_device_time(self, seconds: float) -> None:
        """From the probe thread: a resolved gradient pass's device time (one float store)."""
        if seconds == seconds and seconds > 0:
            cost = self._grad_device_cost
            self._grad_device_cost = seconds if cost == 0.0 else (1 - EMA) * cost + EMA * seconds

    def _sample_seen(self, sample: GradSample) -> bool:
        """Did any trainable layer have a gradient in this sample?"""
        return len(sample.missing) < self._n_trainable

    def _learning_rates(self) -> list[float]:
        if self._optimizer is None:
            return []
        out = []
        for group in self._optimizer.param_groups:
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor):
                # A tensor lr on the GPU (capturable optimizers) would need a sync to read.
                out.append(float(lr) if lr.device.type == "cpu" else NAN)
            else:
                out.append(_number(lr))
        return out

    def measured_costs(self) -> tuple[float, float, float]:
        """What the adaptive interval goes by (running averages, seconds): a step, one gradient
        pass (the larger of host and device time) and the probe's other per-step cost."""
        return self._step_ema, max(self._grad_cost, self._grad_device_cost), self._fixed_cost

    def _update_interval(self, step_time: float, sampled: bool) -> None:
        if sampled:
            self._last_sampled = self.step_count - 1
        if step_time == step_time and step_time > 0:
            self._step_ema = (
                step_time
                if self._step_ema == 0.0
                else ((1 - EMA) * self._step_ema + EMA * step_time)
            )
        if self.grad_every is not None:
            interval = self.grad_every
        else:
            interval = gradient_interval(*self.measured_costs(), self.overhead_budget)
        self.grad_interval = interval
        self._sample_now = self.step_count - self._last_sampled >= interval


def _stage_values(
    pending: PendingStep, sample: GradSample | None, loss_tensor: torch.Tensor | None
) -> None:
    """Put the step's device values (loss, per-parameter norms) on their way to the host."""
    values: list[torch.Tensor] = []
    if loss_tensor is not None:
        if loss_tensor.device.type == "cpu":
            pending.loss_tensor = loss_tensor
        else:
            device = loss_tensor.device
            if sample is not None and isinstance(sample.values, torch.Tensor):
                device = sample.values.device
            values.append(loss_tensor.reshape(1).to(device, torch.float32, non_blocking=True))
            pending.loss_in_values = True
    if sample is not None and isinstance(sample.values, torch.Tensor):
        values.append(sample.values)
    if values:
        vector = values[0] if len(values) == 1 else torch.cat(values)
        if vector.device.type == "cpu":
            pending.values = vector
        elif vector.device.type == "cuda":
            # The step's one device-to-host copy: asynchronous into pinned memory; the probe
            # thread reads it once the event recorded after it (same stream) has completed.
            pending.values = vector.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(vector.device))
            pending.ready = ready
        else:  # mps, xpu, ...: no CUDA events to wait on; a plain copy is correct there
            pending.values = vector.to("cpu")
