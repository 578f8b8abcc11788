"""How a run ended, read once from its end reason: the words a header and a rank's row show."""

from __future__ import annotations

from dataclasses import dataclass

# What a run's end reason (the probe's goodbye, or what the reader saw) means, in words.
END_REASONS = {
    "shutdown": "clean shutdown",
    "closed": "probe closed",
    "slow_consumer": "dropped: this viewer read too slowly",
    "connection closed": "connection lost with no goodbye (killed or crashed?)",
    "killed": "killed (its recording ends without the run's goodbye)",
}


@dataclass(frozen=True)
class Ending:
    """A run's end, classified: ``kind`` is ``clean`` (its probe said goodbye or closed),
    ``dead`` (an exit status or a signal is known, or its recording was cut short), ``lost``
    (the connection went without a word), ``dropped`` (this reader was too slow) or
    ``other``."""

    reason: str  # the reason's core, before any ``; `` tail ("" when none was given)
    tail: str  # what followed ``; `` (``watching for a restart``), else ""
    kind: str

    @property
    def words(self) -> str:
        """For a header or a status line: ``clean shutdown``, ``exit 1: ...``, ``connection
        lost with no goodbye (killed or crashed?)``, with the tail after `` · ``."""
        words = END_REASONS.get(self.reason or "closed", self.reason)
        return f"{words} · {self.tail}" if self.tail else words

    @property
    def row(self) -> str:
        """For a rank's row: ``dead: killed by SIGKILL``, ``lost``, ``ended`` or ``ended
        (REASON)``."""
        if self.kind == "dead":
            return f"dead: {self.reason}"
        if self.kind == "lost":
            return "lost"
        return "ended" if self.reason in ("shutdown", "") else f"ended ({self.reason})"


def ending(reason: str | None) -> Ending:
    """The ending that ``reason`` says (None: the probe closed without saying why)."""
    core, _, tail = (reason or "").partition("; ")
    if core == "exit 0" or core.startswith("exit 0:"):
        kind = "clean"  # exited normally, without its probe's goodbye
    elif core.startswith(("exit ", "killed")):  # an error exit, a signal, a recording cut short
        kind = "dead"
    elif core.startswith("connection"):
        kind = "lost"
    elif core == "slow_consumer":
        kind = "dropped"
    elif core in ("shutdown", "closed", ""):
        kind = "clean"
    else:
        kind = "other"
    return Ending(core, tail, kind)


def how_it_ended(reason: str | None) -> str:
    """The header's words for ``reason``."""
    return ending(reason).words


def ended_words(reason: str | None) -> str:
    """A rank row's words for ``reason``."""
    return ending(reason).row
