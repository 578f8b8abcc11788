"""The step's values as the loop passes them: loss, counts, learning rates, device values staged."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from tdbg.probe.device_copy import host_copy
from tdbg.probe.training import taps
from tdbg.probe.training.gradients import GradSample
from tdbg.probe.training.hooks import CudaMark, perf
from tdbg.probe.training.pending import PendingStep
from tdbg.probe.training.sampler_state import SamplerState
from tdbg.protocol.steps import MAX_LR_COLUMNS

NAN = float("nan")
INF = float("inf")
PLAIN_COUNTS = (int, float)  # samples= / tokens= types read as they are (bool is not one of them)
# The largest count read as it is: an int past it (10**400) has no float; _count reports it.
MAX_COUNT = sys.float_info.max
_Tensor = torch.Tensor


def as_number(value: Any) -> float:
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return NAN


def host_nonfinite(value: Any) -> bool:
    """A loss known to be NaN or Inf without a host-device sync: a Python float or a CPU
    tensor (reading one is a memory load). A device tensor is never read here: False."""
    if isinstance(value, torch.Tensor):
        return taps.nonfinite_on_host(value)
    return isinstance(value, float) and not math.isfinite(value)


def learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    out = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if type(lr) is float:  # nearly always: read at the step pre-hook, in a cold moment
            out.append(lr)
        elif isinstance(lr, torch.Tensor):
            # A tensor lr on the GPU (capturable optimizers) would need a sync to read.
            out.append(float(lr) if lr.device.type == "cpu" else NAN)
        else:
            out.append(as_number(lr))
    return out


class StepValues(SamplerState):
    """Reading what probe.step() is given, once, reporting what cannot be read."""

    __slots__ = ()

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
        value = as_number(loss)
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
        count = as_number(value)
        if 0 <= count < INF:
            return count
        shown = repr(value) if type(value) in (int, float, str) else type(value).__name__
        self.report_once(
            f"{what}-value",
            f"probe.step({what}={shown[:40]}): not a count (a number, 0 or more) — not recorded",
        )
        return NAN

    def _step_lrs(self) -> list[float]:
        lrs: list[float] = []
        for slot in self._slots:
            read, slot.lr = slot.lr, None
            lrs.extend(read if read is not None else learning_rates(slot.optimizer))
        if len(lrs) > MAX_LR_COLUMNS:
            self.report_once(
                "lr-columns",
                f"{len(lrs)} param groups: the learning rates of the first {MAX_LR_COLUMNS} "
                "are shown",
            )
            del lrs[MAX_LR_COLUMNS:]
        return lrs


def stage_values(
    pending: PendingStep,
    sample: GradSample | None,
    scalars: dict[str, Any],
    cuda_device: torch.device | None,
    updates: torch.Tensor | None = None,
    histograms: torch.Tensor | None = None,
) -> CudaMark | None:
    """Put the step's device values (loss, clip norm, per-optimizer losses, per-parameter
    norms, the update ratios ``updates``, the histograms' counts last) on their way to the
    host: CPU values are read now (the loop may write their memory again after the step: an
    accumulator passed as the loss); device ones join the step's one copy. Returns the mark
    whose event tells the copy is done when it was recorded on ``cuda_device``: it also ends
    the step (the next step's data gap starts there), one event fewer a step."""
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
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            pending.host_scalars[name] = value
            continue
        if pending.device_scalars is None:
            pending.device_scalars = []
        pending.device_scalars.append(name)
        values.append(value)
    extra = updates is not None or histograms is not None
    if grads is None and not extra and len(values) == 1 and not values[0].requires_grad:
        # The usual GPU step, the loss alone: copied as it is (one element, any shape and
        # float dtype); the probe thread flattens and converts it. Each op here is
        # microseconds of launch cost.
        vector = values[0]
    elif values or grads is not None or extra:
        if device is None:
            device = updates.device if updates is not None else None
        if device is None and histograms is not None:
            device = histograms.device
        parts: list[torch.Tensor] = []
        for value in values:
            target = device or value.device
            device = target
            parts.append(value.detach().reshape(1).to(target, torch.float32, non_blocking=True))
        if grads is not None:
            parts.append(grads.float())
        if updates is not None:
            parts.append(updates.to(device, torch.float32, non_blocking=True))
            pending.update_count = len(updates)
        if histograms is not None:
            parts.append(histograms.to(device, torch.float32, non_blocking=True))
            pending.histogram_count = len(histograms)
        vector = parts[0] if len(parts) == 1 else torch.cat(parts)
    else:
        return None
    # The step's one device-to-host copy; the probe thread reads it once its event is done.
    pending.values, pending.ready = host_copy(vector, timing=True)
    if pending.ready is not None and vector.device == cuda_device:
        return CudaMark(perf(), pending.ready)
    return None
