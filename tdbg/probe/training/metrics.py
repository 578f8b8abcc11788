"""User metrics (``tdbg.log``): checked on the training thread, read off it, kept bounded."""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tdbg.probe.device_copy import host_copy
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

    A metric is a real number (Python, NumPy, ``numbers.Real``) or a one-element real tensor (a
    device tensor is copied to the host asynchronously and read by the probe thread, as the
    loss is). Each value is read on its own: one that cannot be (not a number, complex, an int
    past float's range, a name that is not a string, names past :data:`MAX_METRIC_NAMES`) is
    reported — once per kind of problem and name, folded with a count past a few names — and
    dropped, and the call's other values are kept; nothing raises into the loop."""

    def __init__(
        self,
        report_once: Callable[[str, str], None],
        inbox: deque[PendingMetrics] | None = None,
    ) -> None:
        """``inbox``: where batches go for the probe thread (the server's); a new one if None."""
        self._report_once = report_once
        self._names: set[str] = set()
        self.inbox: deque[PendingMetrics] = deque(maxlen=MAX_PENDING) if inbox is None else inbox

    def log(self, step: int, metrics: Mapping[Any, Any]) -> None:
        names: list[str] = []
        host: list[float] = []
        device: list[torch.Tensor] = []
        device_names: list[str] = []
        for raw_name, value in metrics.items():
            name = self._name(raw_name)
            if name is None:
                continue
            try:
                read = self._read(name, value)
            except Exception as exc:  # a value's own __float__ raising, say: that value only
                self._report_once(
                    f"metric-type:{name}",
                    f"tdbg.log({name}=...): cannot read a number from {type(value).__name__} "
                    f"({type(exc).__name__}) — not recorded",
                )
                continue
            if read is None or not self._admit(name):
                continue
            if isinstance(read, torch.Tensor):
                device.append(read)
                device_names.append(name)
            else:
                names.append(name)
                host.append(read)
        if not names and not device:
            return
        pending = PendingMetrics(step, names, host, device_names)
        if device:
            vector = torch.cat(device) if len(device) > 1 else device[0]
            pending.values, pending.ready = host_copy(vector)
        self.inbox.append(pending)

    def _read(self, name: str, value: Any) -> float | torch.Tensor | None:
        """The value as a float (host) or a float32 one-element device tensor; None, reported,
        when it is not one real number."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self._report_once(
                    f"metric-shape:{name}",
                    f"tdbg.log({name}=...): a tensor of shape {tuple(value.shape)} is not "
                    "one number — not recorded",
                )
                return None
            if value.is_complex():
                self._complex(name, f"a {value.dtype} tensor")
                return None
            if value.device.type == "cpu":
                return float(value.detach())  # float64 and ints read as they are
            return value.detach().reshape(1).float()
        number = as_number(value)
        if number is _COMPLEX:
            self._complex(name, f"a {type(value).__name__} value")
            return None
        if number is _OVERFLOW:
            self._report_once(
                f"metric-overflow:{name}",
                f"tdbg.log({name}=...): {type(value).__name__} {_short(value)} is past the "
                "range of a float — not recorded",
            )
            return None
        if not isinstance(number, float):
            self._report_once(
                f"metric-type:{name}",
                f"tdbg.log({name}=...): cannot read a number from "
                f"{type(value).__name__} — not recorded",
            )
            return None
        return number

    def _complex(self, name: str, what: str) -> None:
        self._report_once(
            f"metric-complex:{name}",
            f"tdbg.log({name}=...): {what} is complex, not a real number — not recorded "
            "(log its .real, .imag or abs())",
        )

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


_COMPLEX = object()  # as_number: a complex value
_OVERFLOW = object()  # as_number: an integer past float's range


def _short(value: Any) -> str:
    text = str(value) if not isinstance(value, int) or value.bit_length() < 200 else "(huge)"
    return text if len(text) <= 40 else text[:37] + "..."


def as_number(value: Any) -> Any:
    """A float, or _COMPLEX / _OVERFLOW, or None (not a number). bool, int, float, NumPy
    scalars and one-element arrays, and any ``numbers.Real``."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            return _OVERFLOW
    if isinstance(value, numbers.Complex):
        return _COMPLEX
    try:
        import numpy as np

        if isinstance(value, np.ndarray | np.generic) and np.size(value) == 1:
            item = np.asarray(value).reshape(()).item()
            return None if isinstance(item, np.ndarray | np.generic) else as_number(item)
    except ImportError:
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
