"""DeepState: deep-dive commands sent, their jobs, results and activation statistics; no textual."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tdbg.protocol.messages.jobs import FINAL_STATES, Ack, Job
from tdbg.protocol.messages.reports import ProbeHealth
from tdbg.protocol.messages.results import (
    PROFILE_COLUMNS,
    PROFILE_TIME_COLUMNS,
    Activations,
    AnomalyResult,
    NanHuntResult,
    ProfileResult,
    SnapshotResult,
)
from tdbg.protocol.messages.run import read_error

MAX_JOBS = 32  # job records kept (the probe replays its last 32 finished jobs too)
MAX_REQUESTS = 64  # commands this client sent, kept to match their ack / error by id
MAX_PROFILES = 4  # finished profiles kept: the newest is shown, the one before it compared
MAX_NOTICES = 32  # notifications waiting for the app to show them
# Commands whose progress and result the deep-dive panel shows, in its view order.
DIVES = ("profile", "snapshot", "nan_hunt", "anomaly")
TIME_COLUMNS = PROFILE_TIME_COLUMNS
OP_COLUMNS = PROFILE_COLUMNS
LABELS = {
    "profile": "profile",
    "snapshot": "memory snapshot",
    "nan_hunt": "NaN hunt",
    "anomaly": "anomaly mode",
    "activations": "activation statistics",
    "cancel": "cancel",
}


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


def progress(job: Job) -> str:
    """A job as one line: "profile #3: running 2/5 steps", "analysing", "failed: reason"..."""
    head = f"{label(job.command)} #{job.job}"
    total = "?" if job.total is None else str(job.total)
    if job.state == "armed":
        text = "armed, waiting for the next step"
    elif job.state == "running":
        text = f"running {job.done}/{total} steps" if job.total is not None else "running"
        if job.step is not None:
            text += f" (step {job.step})"
    elif job.state == "analysing":
        text = f"analysing {job.done} step{'s' if job.done != 1 else ''}"
    elif job.state in FINAL_STATES - {"done"}:
        text = f"{job.state}: {job.message}" if job.message else job.state
    else:
        text = job.state
    return f"{head}: {text}"


@dataclass
class DeepState:
    """What the deep-dive commands produced, folded in from ack / error / job / activations."""

    requests: dict[int, Request] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)  # the latest message of each job
    job_seq: dict[int, int] = field(default_factory=dict)  # when each job last changed
    # Finished results with their job numbers (the result itself is the protocol's type).
    profiles: deque[tuple[int, ProfileResult]] = field(
        default_factory=lambda: deque(maxlen=MAX_PROFILES)
    )
    snapshot: SnapshotResult | None = None
    snapshot_job: int | None = None
    nan_hunt: NanHuntResult | None = None
    nan_hunt_job: int | None = None
    anomaly: AnomalyResult | None = None  # the last anomaly job's result
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

    def apply(self, message: dict[str, Any]) -> None:
        """Fold a deep-dive message (``job``, ``ack``, ``activations``, ``probe``) into the state;
        other types change nothing. A malformed one may raise TypeError, ValueError or
        AttributeError: the caller decides whether that is news (live) or noise (replay)."""
        mtype = message.get("type")
        if mtype == "job":
            self.apply_job(message)
        elif mtype == "ack":
            self.apply_ack(message)
        elif mtype == "activations":
            self.apply_activations(message)
        elif mtype == "probe":
            self.apply_probe(ProbeHealth.from_wire(message))

    def apply_ack(self, message: dict[str, Any]) -> None:
        ack = Ack.from_wire(message)
        if ack is None:
            return
        request = self.requests.get(ack.id)
        if request is not None:
            request.job = ack.job
            request.warning = ack.message
        if ack.message:
            text = f"{label(ack.command)} #{ack.job}: {ack.message}"
            self.notices.append(Notice(text, "warning"))

    def apply_refusal(self, message: dict[str, Any]) -> bool:
        """An ``error`` that answers one of our commands; False when it is not one."""
        error = read_error(message)
        if error["id"] <= 0:
            return False
        request = self.requests.get(error["id"])
        command = request.command if request is not None else "command"
        reason = f"{error['code']}: {error['message'] or 'refused'}"
        if request is not None:
            self.seq += 1
            request.refused = reason
            request.seq = self.seq
        self.notices.append(Notice(f"{label(command)} refused — {reason}", "error"))
        return True

    def apply_job(self, message: dict[str, Any]) -> None:
        first = Job.from_wire(message)
        if first is None:
            return
        previous = self.jobs.get(first.job)
        # A message without its command is named by an earlier message of the job.
        job = Job.from_wire(message, previous.command if previous is not None else "?")
        assert job is not None
        number, state, history = job.job, job.state, job.history
        self.seq += 1
        self.job_seq[number] = self.seq
        self.jobs.pop(number, None)  # re-insert: the dict stays in order of last update
        self.jobs[number] = job
        self._bound_jobs()
        if job.command == "activations":  # its job runs for as long as statistics are on
            self.activations_enabled = job.active
            self.activations_every = job.args.get("every") or self.activations_every
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
            self.job_seq.pop(number, None)

    def _keep_result(self, job: Job) -> None:
        result = job.result
        if isinstance(result, ProfileResult):
            if all(number != job.job for number, _ in self.profiles):
                self.profiles.append((job.job, result))
        elif isinstance(result, SnapshotResult):
            self.snapshot, self.snapshot_job = result, job.job
        elif isinstance(result, NanHuntResult):
            self.nan_hunt, self.nan_hunt_job = result, job.job
        elif isinstance(result, AnomalyResult):
            self.anomaly = result

    def _announce(self, job: Job) -> None:
        head = f"{label(job.command)} #{job.job}"
        if job.state != "done":
            severity = "error" if job.state == "failed" else "warning"
            self.notices.append(Notice(progress(job), severity))
            return
        if job.command == "profile" and self.profiles and self.profiles[-1][0] == job.job:
            trace = self.profiles[-1][1].trace
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
            errors = self.anomaly.errors if self.anomaly is not None else None
            self.notices.append(Notice(f"{head} is off again ({errors} backward error(s) seen)"))
        elif job.command != "activations":
            self.notices.append(Notice(f"{head} done"))

    def apply_activations(self, message: dict[str, Any]) -> None:
        self.activations = Activations.from_wire(message) or self.activations

    def apply_probe(self, report: ProbeHealth) -> None:
        """The 1 Hz ``probe`` report: the activation interval and the active job numbers (a
        probe that takes no commands says neither)."""
        if report.takes_commands:
            every = report.activations_every
            self.activations_enabled = every is not None
            self.activations_every = every or self.activations_every
            self.active_jobs = list(report.jobs)

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
        if job is not None and self.job_seq.get(job.job, 0) > request.seq:
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
        return self.profiles[-1][1] if self.profiles else None

    @property
    def profile_job(self) -> int | None:
        """The job number of :attr:`profile`."""
        return self.profiles[-1][0] if self.profiles else None

    @property
    def previous_profile(self) -> ProfileResult | None:
        return self.profiles[-2][1] if len(self.profiles) > 1 else None

    @property
    def previous_profile_job(self) -> int | None:
        return self.profiles[-2][0] if len(self.profiles) > 1 else None

    @property
    def has_any(self) -> bool:
        """Anything for the deep-dive panel to show: a dive's job or a refused dive."""
        if any(job.command in DIVES for job in self.jobs.values()):
            return True
        return any(r.refused and r.command in DIVES for r in self.requests.values())
