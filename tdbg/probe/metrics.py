"""User metrics (``tdbg.log``): checked on the training thread, read off it, kept bounded."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tdbg.protocol.messages import MAX_METRIC_NAME

MAX_METRIC_NAMES = 256  # distinct names a run may log; more are dropped, with a note
MAX_PENDING = 4096  # metric batches waiting for the probe thread; the oldest go first
HISTORY_POINTS = 100_000  # points kept for late clients (about 10 MB at most)


@dataclass
class PendingMetrics:
    """One ``log()`` call's points; device values in flight in one non-blocking copy."""

    step: int
    names: list[str]
    host: list[float]  # values already on the host, in ``names`` order first
    device_names: list[str] = field(default_factory=list)
    values: Any = None  # host tensor the device values are copied into
    ready: Any = None  # CUDA event recorded after the copy

    def resolve(self) -> list[tuple[int, str, float]] | None:
        """The points, or None while the copy is in flight. Never blocks."""
        if self.ready is not None and not self.ready.query():
            return None
        points = [(self.step, n, v) for n, v in zip(self.names, self.host, strict=True)]
        if self.values is not None:
            read = self.values.tolist()
            points.extend(
                (self.step, n, float(v)) for n, v in zip(self.device_names, read, strict=True)
            )
        return points


class MetricsDesk:
    """What ``probe.log()`` does on the training thread: O(number of values), never a sync.

    A metric is a Python number or a one-element tensor (a device tensor is copied to the host
    asynchronously and read by the probe thread, as the loss is). A name that is not a string,
    a value that is not a number, and names past :data:`MAX_METRIC_NAMES` are reported once
    each and dropped; nothing raises into the loop."""

    def __init__(self, report_once: Callable[[str, str], None]) -> None:
        self._report_once = report_once
        self._names: set[str] = set()
        self.inbox: deque[PendingMetrics] = deque(maxlen=MAX_PENDING)

    def log(self, step: int, metrics: Mapping[Any, Any]) -> None:
        names: list[str] = []
        host: list[float] = []
        device: list[torch.Tensor] = []
        device_names: list[str] = []
        for raw_name, value in metrics.items():
            name = self._name(raw_name)
            if name is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    self._report_once(
                        f"metric-shape:{name}",
                        f"tdbg.log({name}=...): a tensor of shape {tuple(value.shape)} is not "
                        "one number — not recorded",
                    )
                    continue
                if not self._admit(name):
                    continue
                if value.device.type == "cpu":
                    host.append(float(value.detach()))
                    names.append(name)
                else:
                    device.append(value.detach().reshape(1).float())
                    device_names.append(name)
                continue
            number = _number(value)
            if number is None:
                self._report_once(
                    f"metric-type:{name}",
                    f"tdbg.log({name}=...): cannot read a number from "
                    f"{type(value).__name__} — not recorded",
                )
                continue
            if not self._admit(name):
                continue
            names.append(name)
            host.append(number)
        if not names and not device:
            return
        pending = PendingMetrics(step, names, host, device_names)
        if device:
            vector = torch.cat(device) if len(device) > 1 else device[0]
            if vector.device.type == "cuda":
                pending.values = vector.to("cpu", non_blocking=True)
                pending.ready = torch.cuda.Event()
                pending.ready.record(torch.cuda.current_stream(vector.device))
            else:
                pending.values = vector.to("cpu")
        self.inbox.append(pending)

    def _name(self, raw: Any) -> str | None:
        if not isinstance(raw, str) or not raw:
            self._report_once(
                f"metric-name:{type(raw).__name__}",
                f"tdbg.log: a metric name must be a non-empty string, not {raw!r:.40} — dropped",
            )
            return None
        return raw[:MAX_METRIC_NAME]

    def _admit(self, name: str) -> bool:
        """A name with a good value counts towards the cap; past it new names are dropped."""
        if name not in self._names:
            if len(self._names) >= MAX_METRIC_NAMES:
                self._report_once(
                    "metric-names",
                    f"tdbg.log: more than {MAX_METRIC_NAMES} metric names; new names are "
                    f"dropped (first dropped: {name!r})",
                )
                return False
            self._names.add(name)
        return True


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    try:
        import numpy as np

        if isinstance(value, np.generic) and np.ndim(value) == 0:
            return float(value)
    except Exception:
        pass
    return None


class MetricsHistory:
    """The run's metric points for late clients, the newest :data:`HISTORY_POINTS`, with the
    first non-finite value of every name kept past that (where a NaN began must not scroll
    away)."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, str, float]] = deque(maxlen=HISTORY_POINTS)
        self.first_nonfinite: dict[str, tuple[int, str, float]] = {}

    def add(self, points: list[tuple[int, str, float]]) -> list[str]:
        """Keep ``points``; the names whose first non-finite value is among them."""
        self.points.extend(points)
        new: list[str] = []
        for point in points:
            if not math.isfinite(point[2]) and point[1] not in self.first_nonfinite:
                self.first_nonfinite[point[1]] = point
                new.append(point[1])
        return new

    def replay(self, chunk: int = 5000) -> list[list[tuple[int, str, float]]]:
        kept = set(self.points)
        early = [p for p in self.first_nonfinite.values() if p not in kept]
        points = sorted(early) + list(self.points)
        return [points[i : i + chunk] for i in range(0, len(points), chunk)]
