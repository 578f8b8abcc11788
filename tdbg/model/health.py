"""The run's health in one word — live, stalled, non-finite, input-bound, ended — never stale."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from tdbg.format import fmt_span
from tdbg.model.run_state import RunState

STALL_MIN_SECONDS = 5.0  # a step gap shorter than this is never a stall
STALL_FACTOR = 10.0  # ... nor one shorter than this many recent (median) step times
# A run that steps at least once a second is called stalled after this gap at most, so the
# header (re-judged every second) says so within 10 s of the last step; slower runs get
# STALL_FACTOR of their own step time.
FAST_STEP_SECONDS = 1.0
FAST_STALL_SECONDS = 9.0
RECENT_STEPS = 50


@dataclass(frozen=True)
class Health:
    """A verdict: ``word`` for the header, ``level`` for its colour, ``detail`` for a line."""

    word: str  # "live" | "stalled" | "non-finite" | "input-bound" | "ended" | "probe off" | ...
    level: str  # "ok" | "warn" | "bad" | "idle"
    detail: str
    steps_per_sec: float | None  # a recent window: 0 while stalled, None when unknown

    @property
    def healthy(self) -> bool:
        """What ``tdbg status`` exits 0 for: nothing wrong (a run that ended cleanly included)."""
        return self.level in ("ok", "idle")


def assess(state: RunState, now: float | None = None, by_arrival: bool = False) -> Health:
    """The run's health as of ``now`` (wall clock). How long since the last step is judged by
    the steps' own wall time, or — ``by_arrival``, the live TUI — by when they arrived here
    (a replayed stream or another machine's clock cannot fake a stall); the probe's own
    ``stalled`` alert (with no ``resumed`` after it) says stalled either way."""
    now = time.time() if now is None else now
    probe = state.probe or {}
    rate = state.steps_per_sec()
    if probe.get("disabled"):
        return Health("probe off", "bad", "the probe switched itself off after errors", None)
    if state.ended or probe.get("closed"):
        last = state.last_step
        at = f" at step {last}" if last is not None else ""
        return Health("ended", "idle", f"{how_it_ended(state.end_reason)}{at}", None)
    if not state.n_steps:
        return Health("starting", "idle", "waiting for the first step", None)
    start = _nonfinite_since(state)
    if start is not None:
        return Health("non-finite", "bad", f"loss non-finite since step {start}", rate)
    stall = _stall_alert(state)
    if stall is not None and state.connection == "live":
        return Health("stalled", "bad", stall, 0.0)
    arrived = state.steps_arrived if by_arrival and state.steps_arrived else None
    gap = now - (arrived if arrived is not None else float(state.cols["time"].values[-1]))
    limit = stall_limit(_recent_step_seconds(state))
    if state.connection == "live" and gap > limit:
        return Health("stalled", "bad", f"no step for {fmt_span(gap)}", 0.0)
    if state.input_bound:
        share = state.anatomy()["data_time"] or 0.0
        return Health("input-bound", "warn", f"waiting for data {share:.0%} of each step", rate)
    return Health("live", "ok", "training", rate)


# What a run's end reason (the probe's goodbye, or what the reader saw) means, in words.
END_REASONS = {
    "shutdown": "clean shutdown",
    "closed": "probe closed",
    "slow_consumer": "dropped: this viewer read too slowly",
    "connection closed": "connection lost with no goodbye (killed or crashed?)",
}


def how_it_ended(reason: str | None) -> str:
    """``clean shutdown``, ``connection lost with no goodbye ...``, ``exit 1``; a reason's
    tail after ``; `` (``watching for a restart``) is kept."""
    core, _, rest = (reason or "closed").partition("; ")
    words = END_REASONS.get(core, core)
    return f"{words} · {rest}" if rest else words


def stall_limit(step_seconds: float | None) -> float:
    """How long without a step is a stall, for a run whose recent median step takes
    ``step_seconds`` (None: not known yet)."""
    if step_seconds is None or not step_seconds > 0:
        return FAST_STALL_SECONDS
    limit = max(STALL_MIN_SECONDS, STALL_FACTOR * step_seconds)
    if step_seconds <= FAST_STEP_SECONDS:
        limit = min(limit, FAST_STALL_SECONDS)
    return limit


def _stall_alert(state: RunState) -> str | None:
    """The probe's own stall alert, while no ``resumed`` came after it: what it said."""
    for alert in state.alerts:  # newest first
        if alert.kind == "resumed":
            return None
        if alert.kind == "stalled":
            return alert.message.split(" — ", 1)[0]
    return None


def _nonfinite_since(state: RunState) -> int | None:
    """The first step of the trailing run of non-finite losses, or None if the last is finite."""
    has = state.has_loss.values
    if not has.any():
        return None
    idx = np.flatnonzero(has)
    losses = state.loss.values[idx]
    if math.isfinite(float(losses[-1])):
        return None
    finite = np.flatnonzero(np.isfinite(losses))
    first_bad = int(finite[-1]) + 1 if finite.size else 0
    return int(state.steps.values[idx[first_bad]])


def _recent_step_seconds(state: RunState) -> float | None:
    times = state.cols["time"].values[-RECENT_STEPS:]
    if len(times) < 2:
        return None
    gaps = np.diff(times)
    gaps = gaps[np.isfinite(gaps) & (gaps > 0)]
    return float(np.median(gaps)) if gaps.size else None
