"""The probe's periodic reports, one type each: ``system`` (host, CUDA allocator, NVML) and
``probe`` (its own health and cost). The probe builds them and sends ``to_wire()``; readers take
``from_wire()``, which never raises: a malformed figure reads as None (not measured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tdbg.protocol.messages.tolerant import as_dict, as_float, as_int, as_list, as_str


@dataclass(frozen=True)
class HostStats:
    """This process and its machine: bytes, and the process's CPU percent."""

    rss: int | None = None
    cpu_percent: float | None = None
    ram_used: int | None = None
    ram_total: int | None = None

    @classmethod
    def from_wire(cls, value: Any) -> HostStats:
        d = as_dict(value)
        return cls(
            rss=as_int(d.get("rss")),
            cpu_percent=as_float(d.get("cpu_percent")),
            ram_used=as_int(d.get("ram_used")),
            ram_total=as_int(d.get("ram_total")),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "rss": self.rss,
            "cpu_percent": self.cpu_percent,
            "ram_used": self.ram_used,
            "ram_total": self.ram_total,
        }


@dataclass(frozen=True)
class CudaStats:
    """The CUDA caching allocator's figures for one device in use (bytes, counts)."""

    index: int | None
    name: str | None = None
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    retries: int | None = None
    ooms: int | None = None

    @classmethod
    def from_wire(cls, value: Any) -> CudaStats | None:
        d = value if isinstance(value, dict) else None
        if d is None:
            return None
        return cls(
            index=as_int(d.get("index")),
            name=as_str(d.get("name")),
            allocated=as_int(d.get("allocated")),
            reserved=as_int(d.get("reserved")),
            peak=as_int(d.get("peak")),
            retries=as_int(d.get("retries")),
            ooms=as_int(d.get("ooms")),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
            "retries": self.retries,
            "ooms": self.ooms,
        }


@dataclass(frozen=True)
class GpuStats:
    """One GPU as NVML sees it; any figure NVML would not give is None."""

    index: int | None
    name: str | None = None
    util: float | None = None  # percent
    mem_used: int | None = None  # bytes
    mem_total: int | None = None
    temp: float | None = None  # degrees C
    power: float | None = None  # W
    power_limit: float | None = None
    sm_clock: int | None = None  # MHz

    @classmethod
    def from_wire(cls, value: Any) -> GpuStats | None:
        d = value if isinstance(value, dict) else None
        if d is None:
            return None
        return cls(
            index=as_int(d.get("index")),
            name=as_str(d.get("name")),
            util=as_float(d.get("util")),
            mem_used=as_int(d.get("mem_used")),
            mem_total=as_int(d.get("mem_total")),
            temp=as_float(d.get("temp")),
            power=as_float(d.get("power")),
            power_limit=as_float(d.get("power_limit")),
            sm_clock=as_int(d.get("sm_clock")),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "util": self.util,
            "mem_used": self.mem_used,
            "mem_total": self.mem_total,
            "temp": self.temp,
            "power": self.power,
            "power_limit": self.power_limit,
            "sm_clock": self.sm_clock,
        }


@dataclass(frozen=True)
class System:
    """The ``system`` report (about 1 Hz): host, CUDA allocator and NVML figures, and why a
    figure is missing (no CUDA, no NVML, ...)."""

    time: float | None
    host: HostStats = field(default_factory=HostStats)
    cuda: tuple[CudaStats, ...] = ()
    gpus: tuple[GpuStats, ...] = ()
    missing: tuple[str, ...] = ()

    @classmethod
    def from_wire(cls, value: Any) -> System:
        d = as_dict(value)
        return cls(
            time=as_float(d.get("time")),
            host=HostStats.from_wire(d.get("host")),
            cuda=tuple(c for c in map(CudaStats.from_wire, as_list(d.get("cuda"))) if c),
            gpus=tuple(g for g in map(GpuStats.from_wire, as_list(d.get("gpus"))) if g),
            missing=tuple(m for m in as_list(d.get("missing")) if isinstance(m, str)),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "system",
            "time": self.time,
            "host": self.host.to_wire(),
            "cuda": [c.to_wire() for c in self.cuda],
            "gpus": [g.to_wire() for g in self.gpus],
            "missing": list(self.missing),
        }


@dataclass(frozen=True)
class ProbeHealth:
    """The 1 Hz ``probe`` report: the probe's health and cost (docs/dump.md names each field).
    ``takes_commands``: the probe serves deep-dive commands, so ``activations_every`` (None:
    activation statistics off) and ``jobs`` (the job numbers in flight) are its own."""

    time: float | None
    clients: int | None = None
    dropped: int | None = None
    rejected_peers: int | None = None
    history_bytes: int | None = None
    cost_fraction: float | None = None
    grad_interval: int | None = None
    grad_mode: str | None = None  # "auto" | "fixed"
    overhead_budget: float | None = None
    errors: int | None = None
    last_error: str | None = None
    steps_seen: int | None = None
    disabled: bool = False  # switched off by the error breaker (not: closed at the end)
    closed: bool = False  # the run ended and the probe closed cleanly
    total_steps: int | None = None  # optimizer steps the run will take, where known
    skipped_steps: int = 0  # updates skipped by watch(skip_nonfinite=True)
    amp_skipped_steps: int = 0  # updates AMP's GradScaler skipped (routine: no alert)
    takes_commands: bool = False
    activations_every: int | None = None
    jobs: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, value: Any) -> ProbeHealth:
        d = as_dict(value)
        total = as_int(d.get("total_steps"))
        return cls(
            time=as_float(d.get("time")),
            clients=as_int(d.get("clients")),
            dropped=as_int(d.get("dropped")),
            rejected_peers=as_int(d.get("rejected_peers")),
            history_bytes=as_int(d.get("history_bytes")),
            cost_fraction=as_float(d.get("cost_fraction")),
            grad_interval=as_int(d.get("grad_interval")),
            grad_mode=as_str(d.get("grad_mode")),
            overhead_budget=as_float(d.get("overhead_budget")),
            errors=as_int(d.get("errors")),
            last_error=as_str(d.get("last_error")),
            steps_seen=as_int(d.get("steps_seen")),
            disabled=d.get("disabled") is True,
            closed=d.get("closed") is True,
            total_steps=total if total is not None and total > 0 else None,
            skipped_steps=as_int(d.get("skipped_steps")) or 0,
            amp_skipped_steps=as_int(d.get("amp_skipped_steps")) or 0,
            takes_commands="activations_every" in d or "jobs" in d,
            activations_every=as_int(d.get("activations_every")),
            jobs=tuple(j for j in map(as_int, as_list(d.get("jobs"))) if j is not None),
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "probe",
            "time": self.time,
            "clients": self.clients,
            "dropped": self.dropped,
            "rejected_peers": self.rejected_peers,
            "history_bytes": self.history_bytes,
            "cost_fraction": self.cost_fraction,
            "grad_interval": self.grad_interval,
            "grad_mode": self.grad_mode,
            "overhead_budget": self.overhead_budget,
            "errors": self.errors,
            "last_error": self.last_error,
            "steps_seen": self.steps_seen,
            "disabled": self.disabled,
            "closed": self.closed,
            "total_steps": self.total_steps,
            "skipped_steps": self.skipped_steps,
            "amp_skipped_steps": self.amp_skipped_steps,
        }
        if self.takes_commands:
            out["activations_every"] = self.activations_every
            out["jobs"] = list(self.jobs)
        return out
