"""The one stall rule: how long without a step is a stall, for the probe and every reader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StallRule:
    """A gap with no step is a stall once it passes ``limit(median step time)``.

    The probe announces its rule in its hello (``run["stall"]``), so its own ``stalled`` alert, the
    TUI's header, ``tdbg status``, the picker and a job's rank rows all call the same gap a stall;
    a reader of an older probe (no ``stall`` in its hello) uses the defaults below, which are the
    probe's."""

    # A gap this many times the run's recent median step...
    factor: float = 20.0
    # ...and at least this long (a gap shorter than this is never a stall)...
    min_s: float = 5.0
    # ...except that a run stepping at least once every ``fast_step_s`` is called stalled after
    # ``fast_cap_s`` at most, so a watcher (re-judging every second) sees it within 10 s of the
    # last step; ``fast_cap_s`` is also the limit while the median is not known yet.
    fast_step_s: float = 1.0
    fast_cap_s: float = 9.0

    def limit(self, median_step_s: float | None) -> float:
        """Seconds without a step that make a stall, for a run whose recent median step takes
        ``median_step_s`` (None, or not a positive number: not known yet)."""
        if median_step_s is None or not median_step_s > 0:
            return self.fast_cap_s
        limit = max(self.min_s, self.factor * median_step_s)
        if median_step_s <= self.fast_step_s:
            limit = min(limit, self.fast_cap_s)
        return limit

    def to_wire(self) -> dict[str, float]:
        return {
            "factor": self.factor,
            "min_s": self.min_s,
            "fast_step_s": self.fast_step_s,
            "fast_cap_s": self.fast_cap_s,
        }

    @classmethod
    def from_wire(cls, value: Any) -> StallRule:
        """The rule a hello announced; a missing or malformed figure takes the default (a rule
        from a bad peer must not make every gap a stall, so each figure must be positive)."""
        if not isinstance(value, dict):
            return cls()
        figures: dict[str, float] = {}
        for name, default in cls().to_wire().items():
            raw = value.get(name)
            number = float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else 0
            figures[name] = number if 0 < number < 1e9 else default
        return cls(**figures)


DEFAULT_STALL_RULE = StallRule()
