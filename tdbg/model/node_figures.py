"""One rank's figures as its node's summary carries them, read again only when its steps change."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tdbg.model.ending import ended_words
from tdbg.model.health import last_step_at, stall_limit, stalled
from tdbg.model.job import MAX_PHASE_GAP, RECENT, busy_median, recent_median
from tdbg.model.job_table import rank_gpu, rank_gpu_util
from tdbg.model.medians import row_medians
from tdbg.model.run_state import RunState
from tdbg.model.straggler_history import SPAN, WINDOW
from tdbg.protocol.messages.node_summary import RankFigures, RankWindow
from tdbg.protocol.steps import PHASES


class StepFigures(NamedTuple):
    """What a rank's figures read from its steps alone (the medians, its latest loss and norm):
    the same until its next batch of steps."""

    step: int | None
    n_steps: int
    whole: float | None
    own: float | None
    phases: dict[str, float | None]
    loss: float | None
    grad: float | None
    nonfinite: bool


class _Status(NamedTuple):
    """A rank's state word as judged at ``now`` and what it was judged from."""

    state: RunState
    key: tuple[Any, ...]
    probe: Any
    now: float
    word: str
    since: float  # the step the gap to a stall is measured from (inf: none yet)
    limit: float


@dataclass
class FigureCache:
    """Each rank's ``StepFigures`` as of its steps' revision, its state word and its last
    figures. A rank's ``system`` report (every second) and the clock change its state and
    memory figures, not these: a bridge that read its ranks' medians again on every summary
    spent most of its time there, and judging each rank's health anew took half the rest."""

    by_rank: dict[int, tuple[RunState, int, int, StepFigures]] = field(default_factory=dict)
    status: dict[int, _Status] = field(default_factory=dict)
    # rank -> (its state, its revisions, its state word, its figures without windows)
    last: dict[int, tuple[RunState, tuple[int, int], str, RankFigures]] = field(
        default_factory=dict
    )

    def get(self, rank: int, state: RunState) -> StepFigures:
        # The gradient totals change with the steps, or start over on a new layer list.
        key = (state.steps_revision, state.grad_total.n)
        hit = self.by_rank.get(rank)
        if hit is not None and hit[0] is state and hit[1:3] == key:
            return hit[3]
        figures = step_figures(state)
        self.by_rank[rank] = (state, *key, figures)
        return figures

    def word(self, rank: int, state: RunState, now: float) -> str:
        """``state_word(state, now)``, judged again only when it can differ: the rank's steps,
        alerts, connection or probe report changed, the clock went back, or a live rank's gap
        since its last step passed the stall limit (the one answer that changes with time)."""
        key = (state.steps_revision, state.alert_count, state.connection, state.end_reason)
        hit = self.status.get(rank)
        if (
            hit is not None
            and hit.state is state
            and hit.key == key
            and hit.probe is state.probe
            and now >= hit.now
            and (hit.word == "stalled" or now - hit.since <= hit.limit)
        ):
            return hit.word
        word = state_word(state, now)
        since, limit = math.inf, math.inf
        if state.n_steps:
            since, limit = last_step_at(state, by_arrival=True), stall_limit(state)
        self.status[rank] = _Status(state, key, state.probe, now, word, since, limit)
        return word

    def keep(self, ranks: Iterable[int]) -> None:
        """Forget the ranks not in ``ranks``."""
        for store in (self.by_rank, self.status, self.last):
            for rank in set(store) - set(ranks):
                del store[rank]


def state_word(state: RunState, now: float | None = None) -> str:
    """A rank's state as a summary says it: live, stalled (``assess``'s verdict, the gap to
    its last step measured by arrival: ``health.stalled``), or how it ended."""
    if state.ended:
        return ended_words(state.end_reason)
    return "stalled" if stalled(state, now, by_arrival=True) else "live"


def step_figures(state: RunState) -> StepFigures:
    """The same medians the straggler rule reads (job.py)."""
    grad = state.grad_total.values[-RECENT:]
    grad = grad[np.isfinite(grad)]  # the latest measured (not every step measures it)
    return StepFigures(
        step=state.last_step,
        n_steps=state.n_steps,
        whole=busy_median(state, False),
        own=busy_median(state, True),
        phases={p: recent_median(state, p) for p in PHASES},
        loss=state.last_loss,
        grad=float(grad[-1]) if grad.size else None,
        nonfinite=state.diverged,
    )


def rank_figures(
    rank: int,
    state: RunState,
    now: float | None = None,
    windows_after: int | None = None,
    cache: FigureCache | None = None,
) -> RankFigures:
    """A rank's few figures (``step_figures``), its state now, its memory, and its windows
    finished after step ``windows_after`` (``rank_windows``). With ``cache``, what did not
    change since the last call is not read again."""
    now = time.time() if now is None else now
    windows = rank_windows(state, windows_after)
    if cache is None:
        return _figures(rank, state, step_figures(state), state_word(state, now), windows)
    word = cache.word(rank, state, now)
    last = cache.last.get(rank)
    revisions = (state.revision, state.steps_revision)
    if last is not None and last[0] is state and last[1] == revisions and last[2] == word:
        figures = last[3]  # nothing of the rank changed since (a quiet half-second)
    else:
        figures = _figures(rank, state, cache.get(rank, state), word, ())
        cache.last[rank] = (state, revisions, word, figures)
    return dataclasses.replace(figures, windows=windows) if windows else figures


def _figures(
    rank: int, state: RunState, mine: StepFigures, word: str, windows: tuple[RankWindow, ...]
) -> RankFigures:
    system = state.system
    cuda = system.cuda if system is not None else ()
    gpu = rank_gpu(state)
    return RankFigures(
        rank=rank,
        step=mine.step,
        n_steps=mine.n_steps,
        whole=mine.whole,
        own=mine.own,
        phases=mine.phases,
        loss=mine.loss,
        grad=mine.grad,
        state=word,
        nonfinite=mine.nonfinite,
        windows=windows,
        allocated=_most(d.allocated for d in cuda),
        reserved=_most(d.reserved for d in cuda),
        peak=_most(d.peak for d in cuda),
        rss=system.host.rss if system is not None else None,
        gpu_mem=None if gpu is None else gpu.mem_used,
        gpu_util=rank_gpu_util(state),
        on_gpu=str(state.run.get("device") or "").startswith("cuda"),
    )


def _most(values: Iterable[int | None]) -> int | None:
    """The largest known value (a rank's devices: the one nearest its limit); None if none."""
    return max((v for v in values if v is not None), default=None)


def rank_windows(state: RunState, after: int | None = None) -> tuple[RankWindow, ...]:
    """A rank's medians at the end of each window it finished after the one ending at step
    ``after`` (None: the last SPAN), as the record of the slowest rank over time reads a
    rank's own steps (straggler_history._judge): the viewer judges the job from these."""
    last = state.last_step
    if last is None:
        return ()
    ready = (last + 1) // WINDOW * WINDOW
    if after is not None and after + WINDOW > ready >= after:
        return ()  # nothing finished since (most summaries): no array touched
    steps = state.steps.values
    first = (int(steps[0]) // WINDOW + 1) * WINDOW  # as _first_common starts the record
    if after is not None and after > ready:
        after = None  # the rank is back before what was sent: it restarted; sent afresh
    start = max(first, ready - (SPAN - 1) * WINDOW)
    if after is not None:
        start = max(start, after + WINDOW)
    ends = np.arange(start, ready + 1, WINDOW)
    if not ends.size:
        return ()
    rows = np.searchsorted(steps, ends)
    # Only the rows the windows read: the RECENT measured values a figure takes are among the
    # RECENT * MAX_PHASE_GAP rows before each window's end (not the whole history, each time).
    lo = max(0, int(rows[0]) - RECENT * MAX_PHASE_GAP)
    hi = int(rows[-1])
    rows = rows - lo
    step = state.cols["step_time"].values[lo:hi]
    backward = state.cols["backward_time"].values[lo:hi]
    own = np.where(np.isfinite(backward), step - backward, np.nan)
    whole = window_medians(step, rows, RECENT)
    mine = window_medians(own, rows, RECENT * MAX_PHASE_GAP)
    phases = {
        p: window_medians(state.cols[p].values[lo:hi], rows, RECENT * MAX_PHASE_GAP)
        for p in PHASES
        if p != "backward_time"
    }
    return tuple(
        RankWindow(
            int(end),
            _known(whole[k]),
            _known(mine[k]),
            {p: _known(values[k]) for p, values in phases.items()},
        )
        for k, end in enumerate(ends)
    )


def window_medians(column: np.ndarray, rows: np.ndarray, lookback: int) -> np.ndarray:
    """For each row in ``rows``, the median of the last RECENT measured values of ``column``
    among the ``lookback`` before that row (``recent_values``, ``busy_values``), NaN where
    fewer than half of RECENT: every window at once (one median a window and figure, 64 ranks'
    backlog of 50 windows, took the first summary ~1.5 s on a busy machine)."""
    measured = np.flatnonzero(np.isfinite(column))
    before = np.searchsorted(measured, rows)  # measured values before each row
    at = before[:, None] - RECENT + np.arange(RECENT)[None, :]  # their positions, the last RECENT
    where = measured[np.clip(at, 0, None)] if measured.size else np.zeros_like(at)
    ok = (at >= 0) & (where >= rows[:, None] - lookback)
    table = np.where(ok, column[where] if column.size else np.nan, np.nan)
    counts = ok.sum(axis=1)
    out = row_medians(table)
    out[counts < RECENT // 2] = np.nan
    return out


def _known(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


__all__ = [
    "FigureCache",
    "StepFigures",
    "rank_figures",
    "rank_windows",
    "state_word",
    "step_figures",
]
