"""The terminal bell (and a desktop notification where the terminal shows one) on the first
alert of each kind, so a run going bad reaches someone whose eyes are on another window."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from itertools import islice
from typing import TYPE_CHECKING

from tdbg.model.ending import ending
from tdbg.model.run_state import RunState

if TYPE_CHECKING:  # the job's model: loaded by the job screen, not before a single run's frame
    from tdbg.model.job import Job
    from tdbg.model.job_alerts import JobAlert
from tdbg.protocol.messages.alert import Alert

RING_SEVERITIES = frozenset({"warning", "error"})
OFF_WORDS = frozenset({"0", "off", "no", "false"})
# Terminals that show OSC 9 (iTerm2, WezTerm, Ghostty) or OSC 777 (urxvt, foot) notifications;
# elsewhere the sequence would be ignored at best, so it is not sent (tmux swallows both).
OSC9_PROGRAMS = frozenset({"iTerm.app", "WezTerm", "ghostty"})
OSC777_TERMS = ("rxvt", "foot")


class AlertRinger:
    """Which newly arrived alerts ring: a warning or an error of a kind not rung before in
    this run, not one replayed from before this viewer attached (``history``)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.enabled = env.get("TDBG_BELL", "1").strip().lower() not in OFF_WORDS
        self.notify_with = notification_kind(env)
        self.rung: set[str] = set()
        self.heard = 0  # state.alert_count already looked at

    def new(self, state: RunState) -> list[Alert]:
        """The alerts to ring for since the last call, oldest first (each kind once)."""
        fresh = state.alert_count - self.heard
        self.heard = state.alert_count
        if fresh <= 0:
            return []
        out = []
        for alert in reversed(list(islice(state.alerts, min(fresh, len(state.alerts))))):
            if alert.history or alert.severity not in RING_SEVERITIES or alert.kind in self.rung:
                continue
            self.rung.add(alert.kind)
            out.append(alert)
        return out

    def sequence(self, alert: Alert, run_name: str) -> str:
        """What to write to the terminal for ``alert``: the bell, and a notification where the
        terminal is known to show one."""
        if not self.enabled:
            return ""
        body = _clean(f"{alert.kind}: {alert.headline}")[:200]
        title = _clean(f"tdbg · {run_name}")[:60]
        if self.notify_with == "osc9":
            return f"\x1b]9;{title}: {body}\x07\x07"
        if self.notify_with == "osc777":
            return f"\x1b]777;notify;{title};{body}\x07\x07"
        return "\x07"


class FindingRinger(AlertRinger):
    """Which of a job's findings ring (the job screen): each kind once — a straggler, diverged
    ranks, NaN on some ranks, a hang, a rank that died — and none judged while a rank still
    replays what came before this viewer attached."""

    DEAD = "dead_rank"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(environ)
        self.dead: set[int] = set()  # ranks whose death was looked at

    def new_findings(self, raised: Iterable[JobAlert], job: Job) -> list[Alert]:
        """The findings to ring for among those just ``raised``, and a rank newly dead."""
        replaying = any(not state.synced for state in job.ranks.values())
        out = []
        for finding in raised:
            alert = finding.as_message()
            if finding.cleared or replaying or alert.severity not in RING_SEVERITIES:
                continue
            if finding.kind not in self.rung:
                self.rung.add(finding.kind)
                out.append(alert)
        for rank, state in job.ranks.items():
            if rank in self.dead or not state.ended:
                continue
            self.dead.add(rank)
            end = ending(state.end_reason)
            if end.kind == "dead" and self.DEAD not in self.rung:
                self.rung.add(self.DEAD)
                words = f"rank {rank} died ({end.reason})"
                out.append(Alert(self.DEAD, "error", state.last_step, time.time(), words))
        return out


def notification_kind(env: Mapping[str, str]) -> str | None:
    """``osc9``, ``osc777`` or None: from ``TDBG_NOTIFY`` when set, else from the terminal."""
    chosen = env.get("TDBG_NOTIFY", "").strip().lower()
    if chosen in ("osc9", "osc777"):
        return chosen
    if chosen in OFF_WORDS or env.get("TMUX"):
        return None
    if env.get("TERM_PROGRAM") in OSC9_PROGRAMS:
        return "osc9"
    if env.get("TERM", "").startswith(OSC777_TERMS):
        return "osc777"
    return None


def _clean(text: str) -> str:
    """No control characters (an alert's text must not end the escape sequence early), no ';'
    (OSC 777's separator)."""
    return "".join(c if c.isprintable() else " " for c in text).replace(";", ",")
