"""Which alerts reach a person: each kind once per run (or job finding once per ranks) until it
clears, read from ``tdbg dump``'s events, so a NaN every step is one message, not thousands."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# What clears an open kind besides its own ``cleared`` (job alerts): the loop resumed after a
# stall; a finite loss after a non-finite one; a step whose gradients were measured finite
# after non-finite gradients (a finite loss alone says nothing of them: fp16 without a scaler).
CLEARED_BY_RESUMED = frozenset({"stalled"})
CLEARED_BY_FINITE_LOSS = frozenset({"nonfinite_loss"})
CLEARED_BY_FINITE_GRADS = frozenset({"nonfinite_grad", "nonfinite_origin"})
REARM_STEPS = 100  # a kind quiet this many steps since its last repeat is news again
SEVERITY_WORDS = {"error": "error", "warning": "warning", "info": "info"}


@dataclass
class Notice:
    """One alert that reaches a person: an alert or job alert event as ``tdbg dump`` printed it,
    with what folding did (``repeats`` folded into the previous notice of its kind, ``cleared``
    for the end of one)."""

    event: dict[str, Any]
    key: tuple[Any, ...]
    cleared: bool = False

    @property
    def line(self) -> str:
        """One line for a terminal, a chat message or a log."""
        e = self.event
        who = f"rank {e['rank']} " if e.get("rank") is not None else ""
        if e.get("type") == "job_alert":
            who = f"job {str(e.get('job'))[:12]} "
        step = f" at step {e['step']}" if isinstance(e.get("step"), int) else ""
        kind = str(self.key[1] if self.cleared else e.get("kind") or "alert")  # resumed: stalled
        if self.cleared:
            return f"cleared: {who}{kind}{step}: {e.get('message', '')}"
        severity = SEVERITY_WORDS.get(str(e.get("severity")), "alert")
        return f"{severity}: {who}{kind}{step}: {e.get('message', '')}"

    def as_json(self) -> dict[str, Any]:
        return dict(self.event, notice="cleared" if self.cleared else "started")


@dataclass
class AlertFold:
    """Feeds on dump events; returns the notices to deliver. A kind is open from its first
    alert until it clears (a job alert's ``cleared``, ``resumed`` after ``stalled``, a finite
    loss after a non-finite one) or until it has been quiet for ``rearm`` steps; repeats while
    it is open are counted, not delivered."""

    rearm: int = REARM_STEPS
    open: dict[tuple[Any, ...], int] = field(default_factory=dict)  # key -> its last step
    folded: int = 0  # repeats not delivered

    def feed(self, event: dict[str, Any]) -> list[Notice]:
        etype = event.get("type")
        if etype == "alert":
            return self._alert(event)
        if etype == "job_alert":
            return self._job_alert(event)
        if etype == "step":
            return self._step(event)
        return []

    def _alert(self, event: dict[str, Any]) -> list[Notice]:
        rank, kind = event.get("rank"), str(event.get("kind") or "alert")
        step = event.get("step") if isinstance(event.get("step"), int) else None
        out: list[Notice] = []
        if kind == "resumed":
            for gone in CLEARED_BY_RESUMED:
                if self.open.pop((rank, gone), None) is not None:
                    out.append(Notice(event, (rank, gone), cleared=True))
            return out
        key = (rank, kind)
        last = self.open.get(key)
        if last is not None and not (step is not None and step - last >= self.rearm):
            self.open[key] = step if step is not None else last
            self.folded += 1
            return out
        self.open[key] = step if step is not None else 0
        return [Notice(event, key)]

    def _job_alert(self, event: dict[str, Any]) -> list[Notice]:
        key = ("job", str(event.get("kind")), tuple(event.get("ranks") or ()))
        if event.get("cleared"):
            if self.open.pop(key, None) is None:
                return []
            return [Notice(event, key, cleared=True)]
        if key in self.open:
            self.folded += 1
            return []
        self.open[key] = int(event.get("step") or 0)
        return [Notice(event, key)]

    def _step(self, event: dict[str, Any]) -> list[Notice]:
        rank = event.get("rank")
        out = []
        if _finite(event.get("loss")):
            out += self._clear(rank, CLEARED_BY_FINITE_LOSS, event, "the loss is finite again")
        if _finite(event.get("grad_norm")):  # null on a step whose gradients were not measured
            words = "the gradients are finite again"
            out += self._clear(rank, CLEARED_BY_FINITE_GRADS, event, words)
        return out

    def _clear(
        self, rank: Any, kinds: frozenset[str], event: dict[str, Any], words: str
    ) -> list[Notice]:
        out = []
        for kind in sorted(kinds):
            if self.open.pop((rank, kind), None) is not None:
                cleared = {"type": "alert", "kind": kind, "step": event.get("step")}
                if rank is not None:
                    cleared["rank"] = rank
                out.append(Notice(dict(cleared, message=words), (rank, kind), cleared=True))
        return out


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
