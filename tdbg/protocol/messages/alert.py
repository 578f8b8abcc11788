"""The ``alert`` message: one frozen type the probe builds and every reader keeps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tdbg.protocol.messages.tolerant import as_dict, as_float, as_int, as_list, as_str

# The prose of a stall alert once ended with " — stuck at WHERE"; a probe now also sends
# ``where`` as a field. Only a reader of an older recording (no ``where``) looks for this.
STUCK_AT = " — stuck at "


@dataclass(frozen=True, slots=True)
class Alert:
    """``{kind, severity, step, time, message, layers}`` and the optional fields below;
    ``history: true`` when replayed to a late client. See docs/dump.md for the kinds.

    ``message`` stays readable on its own (older readers and ``tdbg dump`` print it); the facts
    in it that a reader acts on travel as fields too."""

    kind: str
    severity: str  # "error" | "warning" | "info"
    step: int | None
    time: float | None
    message: str
    layers: tuple[str, ...] = ()
    history: bool = False
    # ``stalled``: where the training thread is stuck (its innermost frame of user code), its
    # Python stack (innermost last) and, in a distributed job, the flight recorder's last
    # collective of this rank ({seq, op, sizes, state, group}): the rank with the lowest seq
    # did not enter the others'.
    where: str | None = None
    stack: tuple[str, ...] = ()
    collective: Mapping[str, Any] | None = None
    # Job alerts (``straggler``, ``rank_divergence``, ``hang``), raised by the reader that
    # compares a job's ranks, not by a probe: the ranks named, and ``cleared`` once it is over.
    ranks: tuple[int, ...] | None = None
    cleared: bool = False
    phase: str | None = None  # straggler: what its extra time goes to (input wait, forward, ...)
    slower_by: float | None = None  # straggler: seconds of own work a step over the others
    stacks: Mapping[str, str] = field(default_factory=dict)  # hang: rank -> its thread's stack

    @property
    def nonfinite(self) -> bool:
        """A NaN/inf loss or gradient alert (the header counts them apart)."""
        return self.kind.startswith("nonfinite")

    @property
    def headline(self) -> str:
        """The message without the " — stuck at WHERE" an older probe appended to a stall."""
        if self.where is not None and self.message.endswith(f"{STUCK_AT}{self.where}"):
            return self.message[: -len(STUCK_AT) - len(self.where)]
        return self.message.split(STUCK_AT, 1)[0]

    @classmethod
    def from_wire(cls, value: Any) -> Alert | None:
        """An ``alert`` message; None when it is not a map. A field of the wrong type reads as
        unknown; a stall from an older probe (no ``where``) has its place read from the prose."""
        if not isinstance(value, dict):
            return None
        message = str(value.get("message") or "")
        where = as_str(value.get("where"))
        if where is None and STUCK_AT in message:
            where = message.split(STUCK_AT, 1)[1]
        collective = value.get("collective")
        ranks = value.get("ranks")
        stacks = as_dict(value.get("stacks"))
        return cls(
            kind=str(value.get("kind") or "alert"),
            severity=str(value.get("severity") or "info"),
            step=as_int(value.get("step")),
            time=as_float(value.get("time")),
            message=message,
            layers=tuple(str(x) for x in as_list(value.get("layers"))),
            history=bool(value.get("history")),
            where=where,
            stack=tuple(x for x in as_list(value.get("stack")) if isinstance(x, str)),
            collective=dict(collective) if isinstance(collective, dict) else None,
            ranks=None
            if not isinstance(ranks, list)
            else tuple(r for r in map(as_int, ranks) if r is not None),
            cleared=bool(value.get("cleared")),
            phase=as_str(value.get("phase")),
            slower_by=_finite(as_float(value.get("slower_by"))),
            stacks={str(k): v for k, v in stacks.items() if isinstance(v, str)},
        )

    def to_wire(self) -> dict[str, Any]:
        """The message as sent: optional fields only where they say something."""
        out: dict[str, Any] = {
            "type": "alert",
            "kind": self.kind,
            "severity": self.severity,
            "step": self.step,
            "time": self.time,
            "message": self.message,
            "layers": list(self.layers),
        }
        # In the order older probes and readers wrote them: the bytes of a recording re-sent
        # by ``tdbg dump`` do not change.
        if self.stack:
            out["stack"] = list(self.stack)
        if self.where is not None:
            out["where"] = self.where
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        if self.cleared:
            out["cleared"] = True
        if self.phase is not None:
            out["phase"] = self.phase
        if self.slower_by is not None:
            out["slower_by"] = self.slower_by
        if self.collective is not None:
            out["collective"] = dict(self.collective)
        if self.stacks:
            out["stacks"] = dict(self.stacks)
        if self.history:
            out["history"] = True
        return out


def alert_message(
    kind: str, severity: str, step: int, message: str, layers: Sequence[str], time: float
) -> dict[str, Any]:
    """An ``alert`` as sent: ``kind`` started at ``step`` (see docs/dump.md for the kinds)."""
    return Alert(kind, severity, step, time, message, tuple(layers)).to_wire()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
