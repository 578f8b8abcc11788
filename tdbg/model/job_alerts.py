"""Job findings turned into live alerts: raised once a finding holds, cleared when it is gone."""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tdbg.model.job import (
    PHASE_WORDS,
    RECENT,
    STRAGGLER_RATIO,
    Job,
    JobFinding,
    StragglerMeasure,
    is_straggling,
)
from tdbg.model.job_nodes import NodesJob
from tdbg.model.straggler_history import WINDOW, StragglerHistory
from tdbg.protocol.messages.alert import Alert

# A straggler is raised after it has held this many job steps (the 20-step median already
# needs ~11 slow steps to move: onset is named within 20 steps) ...
ONSET_STEPS = 5
# ... and cleared after this many steps back under the lower ratio below. The gap between the
# two ratios is the hysteresis: a rank hovering around 1.25x neither flaps nor clears.
CLEAR_STEPS = 10
CLEAR_RATIO = 1.10
MAX_EVENTS = 200  # raised and cleared alerts kept, newest first

SEVERITY = {"straggler": "warning", "rank_divergence": "error", "hang": "error"}


def finding_level(kind: str) -> str:
    """A job finding as a verdict level (health.Health.level): a straggler costs time and is a
    warning; diverged ranks, NaN on some ranks and a hang are trouble."""
    return "warn" if kind == "straggler" else "bad"


@dataclass
class JobAlert:
    """One live job alert: a finding that held, until it clears."""

    kind: str
    ranks: list[int]
    step: int
    time: float
    message: str
    finding: JobFinding
    cleared: bool = False

    @property
    def severity(self) -> str:
        if self.cleared:
            return "info"
        return SEVERITY.get(self.kind, "warning")

    def as_message(self) -> Alert:
        """The alert as the protocol's ``alert`` message, with the job fields."""
        f = self.finding
        return Alert(
            self.kind,
            self.severity,
            self.step,
            self.time,
            self.message,
            tuple(f.layers),
            ranks=tuple(self.ranks),
            cleared=self.cleared,
            phase=None if f.phase is None else PHASE_WORDS.get(f.phase, f.phase),
            slower_by=f.slower_by,
            collective=None if f.collective is None else dict(f.collective),
            stacks={str(r): text for r, text in f.stacks.items()},
        )


@dataclass
class _Pending:
    since: int  # the job step the straggler was first seen at
    quiet_since: int | None = None  # the job step it was first seen back under CLEAR_RATIO


class JudgedJob(Protocol):
    """What the alerts read of a job: ``Job`` (every rank's stream) or ``NodesJob`` (its
    nodes' summaries) alike."""

    def rank_steps(self) -> list[int]: ...
    def rank_counts(self) -> list[int]: ...
    def straggler_measures(self) -> list[StragglerMeasure]: ...
    def straggler(self, rank: int, slow: list[int]) -> JobFinding: ...
    def divergence_rule(self) -> tuple[bool, str]: ...
    def hangs(self) -> list[JobFinding]: ...
    def divergences(self) -> list[JobFinding]: ...
    def nonfinite_ranks(self) -> list[JobFinding]: ...


@dataclass
class JobAlerts:
    """Feeds on a Job after each batch; keeps the active alerts and every raise/clear event."""

    active: dict[tuple[str, tuple[int, ...]], JobAlert] = field(default_factory=dict)
    events: list[JobAlert] = field(default_factory=list)  # newest first
    rule: str = ""  # whether the divergence rule applies to this job, and why
    # Which rank was the slowest window after window: the record behind "intermittent".
    history: StragglerHistory = field(default_factory=StragglerHistory)
    _stragglers: dict[int, _Pending] = field(default_factory=dict)
    _step: int | None = None
    _seen: int = 0  # the ranks with a step at the last judgement

    def update(self, job: JudgedJob, now: float | None = None) -> list[JobAlert]:
        """Judge the job at its current step; the alerts raised or cleared by this call."""
        now = _time.time() if now is None else now
        steps = job.rank_steps()
        step = max(steps, default=0)
        out: list[JobAlert] = []
        # Judged again at a new step, or when ranks came (nodes' first summaries come seconds
        # apart: in a job hung before the last came, the step never moves again).
        if self._step is None or step > self._step or len(steps) > self._seen:
            self._step, self._seen = step, len(steps)
            # The record over time first (from the ranks' own steps, or from the windows their
            # nodes' bridges sent): a straggler it shows slow all along is raised at once.
            if isinstance(job, Job):
                self.history.update(job)
            elif isinstance(job, NodesJob):
                self.history.update(job.windowed())
            out.extend(self._judge_stragglers(job, step, now))
        applies, self.rule = job.divergence_rule()
        current = list(job.hangs())
        if applies:
            current.extend(job.divergences())
        current.extend(job.nonfinite_ranks())
        out.extend(self._follow(current, {"hang", "rank_divergence", "nonfinite_ranks"}, step, now))
        for alert in out:
            self.events.insert(0, alert)
        del self.events[MAX_EVENTS:]
        return out

    def ranks_alerted(self) -> dict[int, list[str]]:
        """The active alert kinds by rank (the rank table's alert column)."""
        out: dict[int, list[str]] = {}
        for alert in self.active.values():
            for rank in alert.ranks:
                out.setdefault(rank, []).append(alert.kind)
        return out

    # --- stragglers: raised after ONSET_STEPS, cleared after CLEAR_STEPS ---------------------
    def _judge_stragglers(self, job: JudgedJob, step: int, now: float) -> list[JobAlert]:
        if min(job.rank_counts(), default=0) < RECENT:
            return []  # a few first steps (warm-up, one slow batch) are no window to judge on
        measures = {m.rank: m for m in job.straggler_measures()}
        slow = [r for r, m in measures.items() if is_straggling(m, STRAGGLER_RATIO)]
        if len(slow) == len(measures):
            slow = []  # every rank "slower than the others" is no straggler
        still = [r for r, m in measures.items() if is_straggling(m, CLEAR_RATIO)]
        out: list[JobAlert] = []
        for rank in sorted(set(slow) | set(self._stragglers)):
            key = ("straggler", (rank,))
            alert = self.active.get(key)
            if alert is None:
                # Not raised yet: it must stay slow (over the lower bar) for ONSET_STEPS.
                if rank not in still:
                    self._stragglers.pop(rank, None)  # a blip that never held: forgotten
                    continue
                pending = self._stragglers.setdefault(rank, _Pending(self._slow_since(rank, step)))
                if rank in slow and step - pending.since >= ONSET_STEPS:
                    finding = job.straggler(rank, slow)
                    alert = JobAlert("straggler", [rank], step, now, finding.message, finding)
                    self.active[key] = alert
                    out.append(alert)
                continue
            pending = self._stragglers[rank]
            if rank in still:
                pending.quiet_since = None
                alert.finding = job.straggler(rank, slow or [rank])  # the figures move on
                alert.message = alert.finding.message
                continue
            pending.quiet_since = pending.quiet_since if pending.quiet_since is not None else step
            if step - pending.quiet_since >= CLEAR_STEPS:
                del self.active[key], self._stragglers[rank]
                out.append(self._cleared(alert, step, now, f"rank {rank} caught up"))
        return out

    def _slow_since(self, rank: int, step: int) -> int:
        """The step a straggler seen now was first slow at: where the record's current spell
        of ``rank`` began, when it spans the RECENT steps the rule reads (a rank slow all
        through the history a viewer attached to is named on its first judgement, not
        ONSET_STEPS later; a live onset still waits ONSET_STEPS), else now."""
        recent = self.history.recent
        tally = self.history.tallies.get(rank)
        if not recent or recent[-1].rank != rank or tally is None:
            return step
        if tally.run * WINDOW < RECENT:
            return step
        return min(step, recent[-1].end - tally.run * WINDOW)

    # --- divergence, hang, NaN on some ranks: raised when found, cleared when gone ---------------
    def _follow(
        self, findings: list[JobFinding], kinds: set[str], step: int, now: float
    ) -> list[JobAlert]:
        out: list[JobAlert] = []
        seen = set()
        for finding in findings:
            key = (finding.kind, tuple(finding.ranks))
            seen.add(key)
            if key in self.active:
                self.active[key].finding = finding
                self.active[key].message = finding.message
                continue
            at = finding.step if finding.step is not None else step
            alert = JobAlert(finding.kind, list(finding.ranks), at, now, finding.message, finding)
            self.active[key] = alert
            out.append(alert)
        for key in [k for k in self.active if k[0] in kinds and k not in seen]:
            alert = self.active.pop(key)
            out.append(self._cleared(alert, step, now, _cleared_words(alert)))
        return out

    @staticmethod
    def _cleared(alert: JobAlert, step: int, now: float, words: str) -> JobAlert:
        return replace(alert, step=step, time=now, cleared=True, message=f"cleared: {words}")


def _cleared_words(alert: JobAlert) -> str:
    ranks = ", ".join(map(str, alert.ranks))
    if alert.kind == "hang":
        return f"rank{'s' if len(alert.ranks) > 1 else ''} {ranks} moved on"
    if alert.kind == "rank_divergence":
        return f"rank{'s' if len(alert.ranks) > 1 else ''} {ranks} agree with the others again"
    return f"{alert.kind} on rank {ranks} is gone"


def alert_fields(message: dict[str, Any]) -> dict[str, Any]:
    """The job fields of an ``alert`` message (for readers that show them)."""
    keys = ("ranks", "phase", "slower_by", "collective", "stacks", "cleared")
    return {k: message[k] for k in keys if k in message}
