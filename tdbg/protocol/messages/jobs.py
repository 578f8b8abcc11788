"""A command's answer and progress: ``ack`` and ``job`` (one frozen type each), the job states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tdbg.protocol.messages.commands import read_command_args
from tdbg.protocol.messages.results import JobResult, result_from_wire
from tdbg.protocol.messages.tolerant import as_dict, as_float, as_int, as_str

JOB_STATES = ("armed", "running", "analysing", "done", "failed", "cancelled")
FINAL_STATES = frozenset({"done", "failed", "cancelled"})  # the one owner: nothing follows these
ACTIVE_STATES = frozenset(JOB_STATES) - FINAL_STATES


@dataclass(frozen=True, slots=True)
class Ack:
    """``ack``: command ``id`` was accepted as job number ``job``; ``message`` carries warnings
    (anomaly mode is global and slow)."""

    id: int
    command: str
    job: int
    message: str = ""

    @classmethod
    def from_wire(cls, value: Any) -> Ack | None:
        """None without the id of the command it answers."""
        data = as_dict(value)
        mid = as_int(data.get("id"))
        if mid is None:
            return None
        job = as_int(data.get("job"))
        return cls(
            id=mid,
            command=as_str(data.get("command")) or "command",
            job=0 if job is None else job,
            message=str(data.get("message") or ""),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "ack",
            "id": self.id,
            "command": self.command,
            "job": self.job,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class Job:
    """``job``: a job's progress, sent to every client; ``result`` only with state ``done``.
    Finished jobs are replayed to late clients with ``history: true``."""

    job: int
    command: str
    state: str  # one of JOB_STATES
    step: int | None  # the run's step at this change; None while armed
    time: float
    done: int = 0  # steps run
    total: int | None = None  # steps to run; None for activations
    message: str = ""  # a warning, or why it failed or was cancelled
    args: dict[str, Any] = field(default_factory=dict)  # the command's, defaults filled in
    trigger: str = "manual"  # "manual" | "auto"
    result: JobResult | None = None
    history: bool = False

    @property
    def final(self) -> bool:
        """Nothing follows this state (done, failed, cancelled)."""
        return self.state in FINAL_STATES

    @property
    def active(self) -> bool:
        """Armed, running or analysing (an unknown state counts: it is not known to be over)."""
        return self.state not in FINAL_STATES

    @classmethod
    def from_wire(cls, value: Any, command: str = "") -> Job | None:
        """None without a job number. ``command`` names the job's command where the message
        does not (a later message of the same job may omit it): it types ``args`` and
        ``result``; the job's command is "" when neither names it."""
        data = as_dict(value)
        number = as_int(data.get("job"))
        if number is None:
            return None
        command = as_str(data.get("command")) or command
        return cls(
            job=number,
            command=command,
            state=as_str(data.get("state")) or "?",
            step=as_int(data.get("step")),
            time=as_float(data.get("time")) or 0.0,
            done=as_int(data.get("done")) or 0,
            total=as_int(data.get("total")),
            message=str(data.get("message") or ""),
            args=read_command_args(command, data.get("args")),
            trigger=as_str(data.get("trigger")) or "manual",
            result=result_from_wire(command, data.get("result")),
            history=bool(data.get("history")),
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "job",
            "job": self.job,
            "command": self.command,
            "state": self.state,
            "step": self.step,
            "done": self.done,
            "total": self.total,
            "message": self.message,
            "args": dict(self.args),
            "trigger": self.trigger,
            "time": self.time,
            "result": None if self.result is None else self.result.to_wire(),
        }
        if self.history:
            out["history"] = True
        return out
