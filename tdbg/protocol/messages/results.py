"""Deep-dive results: profile, memory snapshot, NaN hunt, anomaly mode and activation statistics.

Each is one frozen type: the probe builds it and sends ``to_wire()``; a reader calls
``from_wire(value)``, which never raises (a malformed figure reads as None, a malformed list entry
is dropped, a value that is not a map is None), so nothing downstream defends itself again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tdbg.protocol.messages.histograms import read_counts
from tdbg.protocol.messages.tolerant import (
    as_dict,
    as_float,
    as_int,
    as_list,
    as_steps,
    as_str,
    steps_to_wire,
)

MAX_PROFILE_ROWS = 100  # rows a profile sends
PROFILE_TIME_COLUMNS = ("self_cpu", "cpu_total", "self_device", "device_total")
PROFILE_COLUMNS = (*PROFILE_TIME_COLUMNS, "cpu_memory", "device_memory")
ACTIVATION_STATS = ("mean", "std", "min", "max", "zero_frac", "nonfinite")


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A file the probe wrote (trace, snapshot)."""

    path: str
    size: int | None
    sha256: str = ""

    @classmethod
    def from_wire(cls, value: Any) -> FileInfo | None:
        """None without a path."""
        data = as_dict(value)
        path = as_str(data.get("path"))
        if not path:
            return None
        return cls(path, as_int(data.get("size")), as_str(data.get("sha256")) or "")

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One op of a profile's table: times in microseconds, memory in bytes (the op's own)."""

    name: str
    calls: int | None
    self_cpu: float | None
    cpu_total: float | None
    self_device: float | None
    device_total: float | None
    cpu_memory: int | None
    device_memory: int | None

    @classmethod
    def from_wire(cls, value: Any) -> ProfileRow | None:
        """None when it is not a map."""
        if not isinstance(value, dict):
            return None
        return cls(
            name=str(value.get("name") or "?"),
            calls=as_int(value.get("calls")),
            self_cpu=as_float(value.get("self_cpu")),
            cpu_total=as_float(value.get("cpu_total")),
            self_device=as_float(value.get("self_device")),
            device_total=as_float(value.get("device_total")),
            cpu_memory=as_int(value.get("cpu_memory")),
            device_memory=as_int(value.get("device_memory")),
        )

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    def value(self, column: str) -> float | None:
        """A numeric column by name (``calls`` included); None when missing or not a column."""
        if column not in (*PROFILE_COLUMNS, "calls"):
            return None
        v = getattr(self, column)
        return None if v is None else float(v)

    def per_call(self, column: str) -> float | None:
        v = self.value(column)
        if v is None or not self.calls:
            return None
        return v / self.calls


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """A ``profile`` job's result: the top ops, self-time totals over every op, the trace."""

    rows: tuple[ProfileRow, ...]  # at most MAX_PROFILE_ROWS, sorted by ``sort``
    sort: str  # "device_total" | "cpu_total"
    device: bool  # device times were recorded
    total_self_cpu: float | None  # over every op, not only the rows sent
    total_self_device: float | None
    truncated: bool  # more ops than rows
    steps: tuple[int, int] | None = None  # [first, last] profiled
    wall_seconds: float | None = None
    trace: FileInfo | None = None  # the Chrome/Perfetto trace

    @classmethod
    def of_ops(
        cls,
        rows: list[ProfileRow],
        device: bool,
        *,
        steps: tuple[int, int] | None = None,
        wall_seconds: float | None = None,
        trace: FileInfo | None = None,
    ) -> ProfileResult:
        """A profile from every op's row: sorted by device total on device runs (CPU total
        otherwise), at most :data:`MAX_PROFILE_ROWS`, and self-time totals over every op (not
        only the rows kept), so a row's share is its self time over the total."""
        sort = "device_total" if device else "cpu_total"
        ordered = sorted(
            rows, key=lambda r: (-(r.value(sort) or 0.0), -(r.cpu_total or 0.0), r.name)
        )
        return cls(
            rows=tuple(ordered[:MAX_PROFILE_ROWS]),
            sort=sort,
            device=device,
            # rounded to the nanosecond: drops float-summation noise
            total_self_cpu=round(sum(r.self_cpu or 0.0 for r in rows), 3),
            total_self_device=round(sum(r.self_device or 0.0 for r in rows), 3),
            truncated=len(rows) > MAX_PROFILE_ROWS,
            steps=steps,
            wall_seconds=wall_seconds,
            trace=trace,
        )

    @classmethod
    def from_wire(cls, value: Any) -> ProfileResult | None:
        """None when it is not a map. An unknown ``sort`` reads as the probe's default for the
        run (device total on device runs, CPU total otherwise)."""
        if not isinstance(value, dict):
            return None
        device = bool(value.get("device"))
        sort = as_str(value.get("sort"))
        if sort not in PROFILE_TIME_COLUMNS:
            sort = "device_total" if device else "cpu_total"
        rows = (ProfileRow.from_wire(r) for r in as_list(value.get("rows")))
        return cls(
            rows=tuple(r for r in rows if r is not None),
            sort=sort,
            device=device,
            total_self_cpu=as_float(value.get("total_self_cpu")),
            total_self_device=as_float(value.get("total_self_device")),
            truncated=bool(value.get("truncated")),
            steps=as_steps(value.get("steps")),
            wall_seconds=as_float(value.get("wall_seconds")),
            trace=FileInfo.from_wire(value.get("trace")),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "rows": [row.to_wire() for row in self.rows],
            "sort": self.sort,
            "device": self.device,
            "total_self_cpu": self.total_self_cpu,
            "total_self_device": self.total_self_device,
            "truncated": self.truncated,
            "steps": steps_to_wire(self.steps),
            "wall_seconds": self.wall_seconds,
            "trace": None if self.trace is None else self.trace.to_wire(),
        }

    @property
    def share_column(self) -> str:
        """Share of profiled time is self device time on device runs, self CPU time otherwise."""
        return "self_device" if self.device else "self_cpu"

    def share(self, row: ProfileRow) -> float | None:
        """The fraction (0-1) of the profiled self time this op took; None when not
        measurable. The one definition the TUI's table and the CLI's report both print."""
        total = self.total_self_device if self.device else self.total_self_cpu
        value = row.value(self.share_column)
        if value is None or total is None or not total > 0:
            return None
        return value / total


@dataclass(frozen=True, slots=True)
class AllocationSite:
    site: str
    bytes: int | None
    count: int | None


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """A ``snapshot`` job's result: the pickle for https://pytorch.org/memory_viz and a summary."""

    top: tuple[AllocationSite, ...]  # by size, largest first
    active_bytes: int | None
    reserved_bytes: int | None
    file: FileInfo | None = None
    steps: tuple[int, int] | None = None  # [first, last] recorded
    history_owner: str = "tdbg"  # "tdbg" | "script"

    @classmethod
    def from_wire(cls, value: Any) -> SnapshotResult | None:
        """None when it is not a map."""
        if not isinstance(value, dict):
            return None
        top = tuple(
            AllocationSite(
                str(entry.get("site") or "?"),
                as_int(entry.get("bytes")),
                as_int(entry.get("count")),
            )
            for entry in as_list(value.get("top"))
            if isinstance(entry, dict)
        )
        return cls(
            top=top,
            active_bytes=as_int(value.get("active_bytes")),
            reserved_bytes=as_int(value.get("reserved_bytes")),
            file=FileInfo.from_wire(value.get("file")),
            steps=as_steps(value.get("steps")),
            history_owner=as_str(value.get("history_owner")) or "tdbg",
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "file": None if self.file is None else self.file.to_wire(),
            "steps": steps_to_wire(self.steps),
            "history_owner": self.history_owner,
            "top": [asdict(site) for site in self.top],
            "active_bytes": self.active_bytes,
            "reserved_bytes": self.reserved_bytes,
        }


@dataclass(frozen=True, slots=True)
class NanHuntResult:
    """A ``nan_hunt`` job's result: nothing found over ``steps_checked`` steps, or the first
    module whose output or gradient was non-finite (``found=True, phase=..., module=...``)."""

    found: bool = False
    phase: str | None = None  # "forward" | "backward"; None if not found
    module: str | None = None  # as in named_modules(); "" is the root model
    module_type: str | None = None
    step: int | None = None  # where it was found
    nonfinite: int | None = 0
    numel: int | None = 0
    input_min: float | None = None  # of the module's finite inputs
    input_max: float | None = None
    input_nonfinite: bool = False
    params_nonfinite: int | None = 0
    steps_checked: int | None = None
    trigger: str | None = None  # "manual" | "auto"

    @classmethod
    def from_wire(cls, value: Any) -> NanHuntResult | None:
        """None when it is not a map."""
        if not isinstance(value, dict):
            return None
        return cls(
            found=bool(value.get("found")),
            phase=as_str(value.get("phase")),
            module=as_str(value.get("module")),
            module_type=as_str(value.get("module_type")),
            step=as_int(value.get("step")),
            nonfinite=as_int(value.get("nonfinite")),
            numel=as_int(value.get("numel")),
            input_min=as_float(value.get("input_min")),
            input_max=as_float(value.get("input_max")),
            input_nonfinite=bool(value.get("input_nonfinite")),
            params_nonfinite=as_int(value.get("params_nonfinite")),
            steps_checked=as_int(value.get("steps_checked")),
            trigger=as_str(value.get("trigger")),
        )

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def module_label(self) -> str:
        if self.module is None:
            return "n/a"
        return self.module or "(root model)"


@dataclass(frozen=True, slots=True)
class AnomalyResult:
    """An ``anomaly`` job's result."""

    steps: int | None
    check_nan: bool
    errors: int | None  # backward errors seen (each also an ``anomaly`` alert)

    @classmethod
    def from_wire(cls, value: Any) -> AnomalyResult | None:
        """None when it is not a map."""
        if not isinstance(value, dict):
            return None
        return cls(
            as_int(value.get("steps")), bool(value.get("check_nan")), as_int(value.get("errors"))
        )

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class NoResult:
    """The result of a job that has nothing to report (activation statistics turned off)."""

    @classmethod
    def from_wire(cls, value: Any) -> NoResult | None:
        return cls() if isinstance(value, dict) else None

    def to_wire(self) -> dict[str, Any]:
        return {}


JobResult = ProfileResult | SnapshotResult | NanHuntResult | AnomalyResult | NoResult

RESULTS: dict[str, type[ProfileResult | SnapshotResult | NanHuntResult | AnomalyResult]] = {
    "profile": ProfileResult,
    "snapshot": SnapshotResult,
    "nan_hunt": NanHuntResult,
    "anomaly": AnomalyResult,
}


def result_from_wire(command: str, value: Any) -> JobResult | None:
    """A done job's result read by its command's type; None when it is not a map."""
    kind = RESULTS.get(command)
    return kind.from_wire(value) if kind is not None else NoResult.from_wire(value)


@dataclass(frozen=True, slots=True)
class Activations:
    """The ``activations`` message: per-module output statistics of one sampled step; every
    value list is as long as ``names`` (NaN where a figure is missing)."""

    step: int | None
    names: tuple[str, ...]
    types: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min: tuple[float, ...]
    max: tuple[float, ...]
    zero_frac: tuple[float, ...]  # fraction of exact zeros (dead ReLUs)
    nonfinite: tuple[float, ...]  # counts (whole numbers); NaN where a reader found none
    history: bool = False
    # Per module its |output| histogram in the fixed bins of ``histograms`` (None: not counted,
    # as in a recording made before they were), and the stride it was counted with (1: every
    # element; k: one in k, a large output's cost bounded).
    hist: tuple[tuple[int, ...] | None, ...] = ()
    hist_stride: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, value: Any) -> Activations | None:
        """None when it is not a non-empty map; a missing or malformed value reads as NaN, a
        missing type as ""."""
        data = as_dict(value)
        if not data:
            return None
        names = tuple(str(n) for n in as_list(data.get("names")))
        n = len(names)
        types = [str(t) for t in as_list(data.get("types"))][:n]
        types += [""] * (n - len(types))

        def column(key: str) -> tuple[float, ...]:
            values = [as_float(v) for v in as_list(data.get(key))[:n]]
            out = [math.nan if v is None else v for v in values]
            return tuple(out + [math.nan] * (n - len(out)))

        stats = {key: column(key) for key in ACTIVATION_STATS}
        hist: list[tuple[int, ...] | None] = []
        strides: list[int] = []
        if "hist" in data:  # absent from older recordings: no histograms, not n empty ones
            hist = [read_counts(v) for v in as_list(data.get("hist"))[:n]]
            hist += [None] * (n - len(hist))
            read = [as_int(v) for v in as_list(data.get("hist_stride"))[:n]]
            strides = [s if s is not None and s >= 1 else 1 for s in read]
            strides += [1] * (n - len(strides))
        return cls(
            step=as_int(data.get("step")),
            names=names,
            types=tuple(types),
            **stats,  # the six value columns, by name
            history=bool(data.get("history")),
            hist=tuple(hist),
            hist_stride=tuple(strides),
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "activations",
            "step": self.step,
            "names": list(self.names),
            "types": list(self.types),
        }
        out.update((key, list(getattr(self, key))) for key in ACTIVATION_STATS)
        if self.hist:
            out["hist"] = [None if h is None else list(h) for h in self.hist]
            out["hist_stride"] = list(self.hist_stride)
        if self.history:
            out["history"] = True
        return out
