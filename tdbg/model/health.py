"""The run's health in one word — live, stalled, non-finite, input-bound, ended — never stale."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tdbg.format import fmt_span
from tdbg.model.ending import ending
from tdbg.model.medians import median
from tdbg.model.run_state import Alert, RunState
from tdbg.protocol.stall import StallRule

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
        """Nothing wrong: live, starting, ended cleanly — or only a warning (input-bound is a
        performance trait, not trouble). ``tdbg status`` exits 1 when a run is not healthy."""
        return self.level != "bad"


def assess(state: RunState, now: float | None = None, by_arrival: bool = False) -> Health:
    """The run's health as of ``now`` (wall clock). How long since the last step is judged by
    the steps' own wall time, or — ``by_arrival``, the live TUI — by when they arrived here
    (a replayed stream or another machine's clock cannot fake a stall); the probe's own
    ``stalled`` alert (with no ``resumed`` after it) says stalled either way."""
    now = time.time() if now is None else now
    rate = state.steps_per_sec()
    if state.probe_disabled:
        return Health("probe off", "bad", "the probe switched itself off after errors", None)
    if state.ended or state.probe_closed:
        last = state.last_step
        at = f" at step {last}" if last is not None else ""
        how = ending(state.end_reason)
        level = "bad" if how.kind == "dead" else "idle"  # a crash or a kill is trouble
        return Health("ended", level, f"{how.words}{at}", None)
    if not state.n_steps:
        return Health("starting", "idle", "waiting for the first step", None)
    start = state.nonfinite_since
    if start is not None:
        return Health("non-finite", "bad", f"loss non-finite since step {start}", rate)
    why = _stalled_why(state, now, by_arrival)
    if why is not None:
        return Health("stalled", "bad", why, 0.0)
    if state.input_bound:
        share = state.anatomy()["data_time"] or 0.0
        return Health("input-bound", "warn", f"waiting for data {share:.0%} of each step", rate)
    return Health("live", "ok", "training", rate)


def stalled(state: RunState, now: float | None = None, by_arrival: bool = False) -> bool:
    """Whether ``assess`` calls the run stalled, without the rest of its verdict: its step
    rate and input share cost ~100 µs a run after new steps, and a node's bridge judges each
    of its ranks twice a second for this word alone."""
    if state.probe_disabled or state.ended or state.probe_closed or not state.n_steps:
        return False  # assess's verdicts before the stall's: probe off, ended, starting
    if state.nonfinite_since is not None:
        return False
    return _stalled_why(state, time.time() if now is None else now, by_arrival) is not None


def _stalled_why(state: RunState, now: float, by_arrival: bool) -> str | None:
    """Why a live run with steps and a finite loss is stalled: the probe's own open stall,
    or no step for longer than the stall rule allows; None when it is not."""
    if state.connection != "live":
        return None
    stall = open_stall(state)
    if stall is not None:
        return stall.headline
    gap = now - last_step_at(state, by_arrival)
    return f"no step for {fmt_span(gap)}" if gap > stall_limit(state) else None


def last_step_at(state: RunState, by_arrival: bool = False) -> float:
    """When the run's last step was (its own clock), or arrived here (``by_arrival``, once
    any has): ``assess`` measures the gap to a stall from it. The run has a step."""
    arrived = state.steps_arrived if by_arrival and state.steps_arrived else None
    return arrived if arrived is not None else float(state.cols["time"].values[-1])


def stall_limit(state: RunState) -> float:
    """Seconds without a step after which ``assess`` calls a live run stalled (the probe's
    rule, from its recent step times). Both change only with the steps: a caller that judges
    many runs often (a node's bridge) keeps them until then."""
    return stall_rule(state).limit(_recent_step_seconds(state))


def stall_rule(state: RunState) -> StallRule:
    """The stall rule the run's probe announced in its hello (the defaults for an older one)."""
    return StallRule.from_wire(state.run.get("stall"))


def open_stall(state: RunState) -> Alert | None:
    """The probe's own ``stalled`` alert while no ``resumed`` came after it, else None."""
    for alert in state.alerts:  # newest first
        if alert.kind == "resumed":
            return None
        if alert.kind == "stalled":
            return alert
    return None


def _recent_step_seconds(state: RunState) -> float | None:
    times = state.cols["time"].values[-RECENT_STEPS:]
    if len(times) < 2:
        return None
    gaps = np.diff(times)
    gaps = gaps[np.isfinite(gaps) & (gaps > 0)]
    return median(gaps) if gaps.size else None  # the same value as np.median's, ~10x sooner
