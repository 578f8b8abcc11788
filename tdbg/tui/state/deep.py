"""DeepState: deep-dive commands sent, their jobs, results and activation statistics; no textual."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_JOBS = 32  # job records kept (the probe replays its last 32 finished jobs too)
MAX_REQUESTS = 64  # commands this client sent, kept to match their ack / error by id
MAX_PROFILES = 4  # finished profiles kept: the newest is shown, the one before it compared
MAX_NOTICES = 32  # notifications waiting for the app to show them
FINAL = frozenset({"done", "failed", "cancelled"})  # = protocol.FINAL_STATES, kept import-free
ACTIVE = frozenset({"armed", "running", "analysing"})
# Commands whose progress and result the deep-dive panel shows, in its view order.
DIVES = ("profile", "snapshot", "nan_hunt", "anomaly")
TIME_COLUMNS = ("self_cpu", "cpu_total", "self_device", "device_total")
OP_COLUMNS = (*TIME_COLUMNS, "cpu_memory", "device_memory")
LABELS = {
    "profile": "profile",
    "snapshot": "memory snapshot",
    "nan_hunt": "NaN hunt",
    "anomaly": "anomaly mode",
    "activations": "activation statistics",
    "cancel": "cancel",
}


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def label(command: str) -> str:
    """A command as the user reads it ("NaN hunt", not "nan_hunt")."""
    return LABELS.get(command, command)


@dataclass(slots=True)
class Notice:
    """Something the user should see once, as a notification."""

    text: str
    severity: str = "information"  # information | warning | error (Textual's severities)


@dataclass(slots=True)
class Request:
    """A command this client sent: answered by an ``ack`` (job set) or an ``error`` (refused)."""

    id: int
    command: str
    args: dict[str, Any]
    seq: int
    job: int | None = None
    refused: str | None = None  # "CODE: message" when the probe refused it
    warning: str = ""  # the ack's message (e.g. anomaly mode is global and slow)


@dataclass(slots=True)
class FileRef:
    """A file the probe wrote (trace, snapshot): only its path and size travel on the wire."""

    path: str
    size: int | None

    @classmethod
    def parse(cls, value: Any) -> FileRef | None:
        data = _dict(value)
        path = _str(data.get("path"))
        return cls(path, _int(data.get("size"))) if path else None


@dataclass(slots=True)
class OpRow:
    """One op of a profile's top-ops table: times in microseconds, memory in bytes."""

    name: str
    calls: int | None
    self_cpu: float | None
    cpu_total: float | None
    self_device: float | None
    device_total: float | None
    cpu_memory: int | None
    device_memory: int | None

    def value(self, column: str) -> float | None:
        """A numeric column by name (``calls`` included); None when missing."""
        v = getattr(self, column, None) if column in (*OP_COLUMNS, "calls") else None
        return float(v) if isinstance(v, int | float) else None

    def per_call(self, column: str) -> float | None:
        v = self.value(column)
        if v is None or not self.calls:
            return None
        return v / self.calls


@dataclass(slots=True)
class ProfileResult:
    """A finished profile: the top ops (at most 100, as sent) and the trace file."""

    job: int
    rows: list[OpRow]
    sort: str
    device: bool
    steps: tuple[int | None, int | None]
    wall_seconds: float | None
    total_self_cpu: float | None
    total_self_device: float | None
    trace: FileRef | None
    truncated: bool

    @classmethod
    def parse(cls, job: int, result: dict[str, Any]) -> ProfileResult:
        rows = []
        for raw in _list(result.get("rows")):
            row = _dict(raw)
            rows.append(
                OpRow(
                    name=str(row.get("name") or "?"),
                    calls=_int(row.get("calls")),
                    self_cpu=_float(row.get("self_cpu")),
                    cpu_total=_float(row.get("cpu_total")),
                    self_device=_float(row.get("self_device")),
                    device_total=_float(row.get("device_total")),
                    cpu_memory=_int(row.get("cpu_memory")),
                    device_memory=_int(row.get("device_memory")),
                )
            )
        device = bool(result.get("device"))
        sort = _str(result.get("sort"))
        if sort not in TIME_COLUMNS:
            sort = "device_total" if device else "cpu_total"
        steps = _list(result.get("steps"))
        first = _int(steps[0]) if steps else None
        last = _int(steps[-1]) if steps else None
        return cls(
            job=job,
            rows=rows,
            sort=sort,
            device=device,
            steps=(first, last),
            wall_seconds=_float(result.get("wall_seconds")),
            total_self_cpu=_float(result.get("total_self_cpu")),
            total_self_device=_float(result.get("total_self_device")),
            trace=FileRef.parse(result.get("trace")),
            truncated=bool(result.get("truncated")),
        )

    @property
    def share_column(self) -> str:
        """Share of profiled time is self device time on device runs, self CPU time otherwise."""
        return "self_device" if self.device else "self_cpu"

    def share(self, row: OpRow) -> float | None:
        """The fraction of the profiled (self) time this op took; None when not measurable."""
        total = self.total_self_device if self.device else self.total_self_cpu
        value = row.value(self.share_column)
        if value is None or total is None or not total > 0:
            return None
        return value / total


@dataclass(slots=True)
class SnapshotResult:
    job: int
    file: FileRef | None
    steps: tuple[int | None, int | None]
    top: list[tuple[str, int | None, int | None]]  # (site, bytes, count), largest first
    active_bytes: int | None
    reserved_bytes: int | None

    @classmethod
    def parse(cls, job: int, result: dict[str, Any]) -> SnapshotResult:
        top = []
        for raw in _list(result.get("top")):
            entry = _dict(raw)
            top.append(
                (str(entry.get("site") or "?"), _int(entry.get("bytes")), _int(entry.get("count")))
            )
        steps = _list(result.get("steps"))
        return cls(
            job=job,
            file=FileRef.parse(result.get("file")),
            steps=(_int(steps[0]) if steps else None, _int(steps[-1]) if steps else None),
            top=top,
            active_bytes=_int(result.get("active_bytes")),
            reserved_bytes=_int(result.get("reserved_bytes")),
        )


@dataclass(slots=True)
class NanHuntResult:
    job: int
    found: bool
    phase: str | None
    module: str | None  # as in named_modules(); "" is the root model
    module_type: str | None
    step: int | None
    nonfinite: int | None
    numel: int | None
    input_min: float | None
    input_max: float | None
    input_nonfinite: bool
    params_nonfinite: int | None
    steps_checked: int | None
    trigger: str | None

    @classmethod
    def parse(cls, job: int, result: dict[str, Any]) -> NanHuntResult:
        return cls(
            job=job,
            found=bool(result.get("found")),
            phase=_str(result.get("phase")),
            module=_str(result.get("module")),
            module_type=_str(result.get("module_type")),
            step=_int(result.get("step")),
            nonfinite=_int(result.get("nonfinite")),
            numel=_int(result.get("numel")),
            input_min=_float(result.get("input_min")),
            input_max=_float(result.get("input_max")),
            input_nonfinite=bool(result.get("input_nonfinite")),
            params_nonfinite=_int(result.get("params_nonfinite")),
            steps_checked=_int(result.get("steps_checked")),
            trigger=_str(result.get("trigger")),
        )

    @property
    def module_label(self) -> str:
        if self.module is None:
            return "n/a"
        return self.module or "(root model)"


@dataclass(slots=True)
class Job:
    """The latest ``job`` message for one job number."""

    job: int
    command: str
    state: str
    step: int | None
    done: int | None
    total: int | None
    message: str
    args: dict[str, Any]
    time: float | None
    result: dict[str, Any] | None
    history: bool
    seq: int

    @property
    def active(self) -> bool:
        return self.state not in FINAL

    def progress(self) -> str:
        """One line: "profile #3: running 2/5 steps", "analysing", "failed: reason"..."""
        head = f"{label(self.command)} #{self.job}"
        total = "?" if self.total is None else str(self.total)
        done = "?" if self.done is None else str(self.done)
        if self.state == "armed":
            text = "armed, waiting for the next step"
        elif self.state == "running":
            text = f"running {done}/{total} steps" if self.total is not None else "running"
            if self.step is not None:
                text += f" (step {self.step})"
        elif self.state == "analysing":
            text = f"analysing {done} step{'s' if self.done != 1 else ''}"
        elif self.state in ("failed", "cancelled"):
            text = f"{self.state}: {self.message}" if self.message else self.state
        else:
            text = self.state
        return f"{head}: {text}"


@dataclass(slots=True)
class Activations:
    """Per-module output statistics of one sampled step; value arrays in ``names`` order."""

    step: int | None
    names: list[str]
    types: list[str]
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    zero_frac: np.ndarray
    nonfinite: np.ndarray  # float, so a missing count can be NaN

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Activations:
        names = [str(n) for n in _list(message.get("names"))]
        n = len(names)
        types = [str(t) for t in _list(message.get("types"))][:n]
        types += [""] * (n - len(types))

        def column(key: str) -> np.ndarray:
            out = np.full(n, np.nan)
            values = [_float(v) for v in _list(message.get(key))[:n]]
            out[: len(values)] = [math.nan if v is None else v for v in values]
            return out

        return cls(
            step=_int(message.get("step")),
            names=names,
            types=types,
            mean=column("mean"),
            std=column("std"),
            min=column("min"),
            max=column("max"),
            zero_frac=column("zero_frac"),
            nonfinite=column("nonfinite"),
        )


@dataclass
class DeepState:
    """What the deep-dive commands produced, folded in from ack / error / job / activations."""

    requests: dict[int, Request] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    profiles: deque[ProfileResult] = field(default_factory=lambda: deque(maxlen=MAX_PROFILES))
    snapshot: SnapshotResult | None = None
    nan_hunt: NanHuntResult | None = None
    anomaly: dict[str, Any] | None = None  # the last anomaly job's result
    activations: Activations | None = None
    activations_every: int | None = None  # sampling interval, when known
    activations_enabled: bool = False
    active_jobs: list[int] = field(default_factory=list)  # as the probe's 1 Hz report lists them
    notices: deque[Notice] = field(default_factory=lambda: deque(maxlen=MAX_NOTICES))
    seq: int = 0  # orders requests and jobs: which came last

    # --- updates --------------------------------------------------------------------------

    def sent(self, mid: int, command: str, args: dict[str, Any]) -> None:
        """This client sent ``command`` with id ``mid`` (called by the app, on the UI thread)."""
        self.seq += 1
        self.requests[mid] = Request(mid, command, dict(args), self.seq)
        while len(self.requests) > MAX_REQUESTS:
            del self.requests[next(iter(self.requests))]

    def apply_ack(self, message: dict[str, Any]) -> None:
        mid = _int(message.get("id"))
        job = _int(message.get("job"))
        command = str(message.get("command") or "command")
        warning = str(message.get("message") or "")
        request = self.requests.get(mid) if mid is not None else None
        if request is not None:
            request.job = job
            request.warning = warning
        if warning:
            self.notices.append(Notice(f"{label(command)} #{job}: {warning}", "warning"))

    def apply_refusal(self, message: dict[str, Any]) -> bool:
        """An ``error`` that answers one of our commands; False when it is not one."""
        mid = _int(message.get("id"))
        if mid is None or mid <= 0:
            return False
        request = self.requests.get(mid)
        command = request.command if request is not None else "command"
        reason = f"{message.get('code') or 'ERROR'}: {message.get('message') or 'refused'}"
        if request is not None:
            self.seq += 1
            request.refused = reason
            request.seq = self.seq
        self.notices.append(Notice(f"{label(command)} refused — {reason}", "error"))
        return True

    def apply_job(self, message: dict[str, Any]) -> None:
        number = _int(message.get("job"))
        if number is None:
            return
        previous = self.jobs.get(number)
        command = str(message.get("command") or (previous.command if previous else "?"))
        state = str(message.get("state") or "?")
        result = message.get("result")
        history = bool(message.get("history"))
        self.seq += 1
        job = Job(
            job=number,
            command=command,
            state=state,
            step=_int(message.get("step")),
            done=_int(message.get("done")),
            total=_int(message.get("total")),
            message=str(message.get("message") or ""),
            args=_dict(message.get("args")),
            time=_float(message.get("time")),
            result=result if isinstance(result, dict) else None,
            history=history,
            seq=self.seq,
        )
        self.jobs.pop(number, None)  # re-insert: the dict stays in order of last update
        self.jobs[number] = job
        self._bound_jobs()
        if command == "activations":  # its job runs for as long as statistics are on
            self.activations_enabled = job.active
            self.activations_every = _int(job.args.get("every")) or self.activations_every
        already_final = previous is not None and not previous.active
        if job.active or already_final:
            return
        if state == "done" and job.result is not None:
            self._keep_result(job)
        if not history:
            self._announce(job)

    def _bound_jobs(self) -> None:
        excess = len(self.jobs) - MAX_JOBS
        if excess <= 0:
            return
        # Drop the oldest finished jobs; an active job is never forgotten.
        for number in [n for n, j in self.jobs.items() if not j.active][:excess]:
            del self.jobs[number]

    def _keep_result(self, job: Job) -> None:
        result = job.result or {}
        if job.command == "profile":
            if all(p.job != job.job for p in self.profiles):
                self.profiles.append(ProfileResult.parse(job.job, result))
        elif job.command == "snapshot":
            self.snapshot = SnapshotResult.parse(job.job, result)
        elif job.command == "nan_hunt":
            self.nan_hunt = NanHuntResult.parse(job.job, result)
        elif job.command == "anomaly":
            self.anomaly = dict(result, job=job.job)

    def _announce(self, job: Job) -> None:
        head = f"{label(job.command)} #{job.job}"
        if job.state != "done":
            severity = "error" if job.state == "failed" else "warning"
            self.notices.append(Notice(job.progress(), severity))
            return
        if job.command == "profile" and self.profiles and self.profiles[-1].job == job.job:
            trace = self.profiles[-1].trace
            where = f": trace {trace.path}" if trace else ""
            self.notices.append(Notice(f"{head} done{where}"))
        elif job.command == "snapshot" and self.snapshot and self.snapshot.file:
            self.notices.append(Notice(f"{head} done: {self.snapshot.file.path}"))
        elif job.command == "nan_hunt" and self.nan_hunt is not None:
            hunt = self.nan_hunt
            if hunt.found:
                text = (
                    f"{head}: first non-finite value in {hunt.module_label} "
                    f"({hunt.module_type or '?'}), {hunt.phase or '?'}"
                )
                self.notices.append(Notice(text, "warning"))
            else:
                checked = hunt.steps_checked
                self.notices.append(Notice(f"{head}: no non-finite value in {checked} step(s)"))
        elif job.command == "anomaly":
            errors = _int((job.result or {}).get("errors"))
            self.notices.append(Notice(f"{head} is off again ({errors} backward error(s) seen)"))
        elif job.command != "activations":
            self.notices.append(Notice(f"{head} done"))

    def apply_activations(self, message: dict[str, Any]) -> None:
        self.activations = Activations.parse(message)

    def apply_probe(self, message: dict[str, Any]) -> None:
        """The 1 Hz ``probe`` report: the activation interval and the active job numbers."""
        if "activations_every" in message:
            every = _int(message.get("activations_every"))
            self.activations_enabled = every is not None
            self.activations_every = every or self.activations_every
        if "jobs" in message:
            self.active_jobs = [j for j in map(_int, _list(message.get("jobs"))) if j is not None]

    def drain_notices(self) -> list[Notice]:
        out = list(self.notices)
        self.notices.clear()
        return out

    # --- derived --------------------------------------------------------------------------

    def latest_job(self, command: str) -> Job | None:
        """The most recently updated job of a command."""
        for job in reversed(self.jobs.values()):
            if job.command == command:
                return job
        return None

    def active_job(self, command: str) -> Job | None:
        job = self.latest_job(command)
        return job if job is not None and job.active else None

    def latest_request(self, command: str) -> Request | None:
        for request in reversed(self.requests.values()):
            if request.command == command:
                return request
        return None

    def refusal(self, command: str) -> str | None:
        """Why the last ``command`` sent was refused, unless a job of that kind came since."""
        request = self.latest_request(command)
        if request is None or request.refused is None:
            return None
        job = self.latest_job(command)
        if job is not None and job.seq > request.seq:
            return None
        return request.refused

    def newest_dive(self) -> Job | None:
        """The most recently updated profile / snapshot / NaN-hunt / anomaly job."""
        for job in reversed(self.jobs.values()):
            if job.command in DIVES:
                return job
        return None

    @property
    def anomaly_on(self) -> bool:
        """Autograd anomaly mode is armed or running in the training process."""
        return self.active_job("anomaly") is not None

    @property
    def activations_on(self) -> bool:
        return self.activations_enabled

    @property
    def profile(self) -> ProfileResult | None:
        return self.profiles[-1] if self.profiles else None

    @property
    def previous_profile(self) -> ProfileResult | None:
        return self.profiles[-2] if len(self.profiles) > 1 else None

    @property
    def has_any(self) -> bool:
        """Anything for the deep-dive panel to show: a dive's job or a refused dive."""
        if any(job.command in DIVES for job in self.jobs.values()):
            return True
        return any(r.refused and r.command in DIVES for r in self.requests.values())
