"""Which rank was the slowest, window after window: how often, in how many spells, how long, in
which phase — so a straggler that stays is told from one that comes and goes, and from noise."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tdbg.model.job import (
    RECENT,
    STRAGGLER_RATIO,
    Job,
    busy_values,
    compare_busy,
    is_straggling,
    recent_median,
)
from tdbg.model.medians import row_medians
from tdbg.model.run_state import RunState
from tdbg.protocol.steps import PHASE_WORDS, PHASES

WINDOW = 10  # steps one verdict covers: the job is judged as at every WINDOW-th step
SPAN = 50  # the windows the recent record keeps: the last 500 steps
MIN_JUDGED = 10  # windows judged (100 steps) before any rank is named
MIN_SHARE = 0.10  # a rank is named once it was the slowest in this share of the span...
MIN_WINDOWS = 3  # ...and in this many windows at least (a blip or two is not a pattern)
MOST = 0.75  # the slowest this much of the span: there all along, whatever its short gaps
MOSTLY = 2 / 3  # one phase explains this share of a rank's slow windows: named alone
# The ranks a slow rank's phases are compared with, evenly spaced among the others: the
# typical rank's phase times need a few dozen, not all 1,024.
PHASE_PEERS = 64


@dataclass(frozen=True)
class Window:
    """One judged window: steps [end - WINDOW, end), its slowest rank and why (None: none)."""

    end: int
    rank: int | None
    phase: str | None  # the step column that explains it (PHASES), None when none does


@dataclass
class Tally:
    """One rank's record since the job was first judged (a few integers: O(1) a rank)."""

    windows: int = 0
    spells: int = 0
    longest: int = 0  # windows
    run: int = 0  # the current spell's windows (0: not the slowest in the latest window)


@dataclass(frozen=True)
class RankRecord:
    """One rank's record as the slowest over the recent span, and since the job was first judged."""

    rank: int
    kind: str  # "persistent" | "intermittent" | "earlier" | "" (not named: too little)
    span: int  # steps judged in the recent span
    steps: int  # of those, steps in windows it was the slowest in
    spells: int  # runs of consecutive such windows
    longest: int  # steps, the longest spell
    ongoing: bool  # the slowest in the latest window
    first: int  # the first step of its first slow window in the span
    last: int  # the last step of its last slow window in the span
    phases: list[tuple[str | None, int]]  # (phase, slow windows it explains), most first
    total_steps: int  # since the job was first judged
    total_spells: int
    total_longest: int

    @property
    def share(self) -> float:
        return self.steps / self.span if self.span else 0.0

    def phase_words(self) -> str:
        """``input wait`` when one phase explains most of its slow windows, else the two
        leading ones with their shares."""
        count = sum(n for _, n in self.phases)
        if not count:
            return "no phase stands out"
        named = [(PHASE_WORDS.get(p, p) if p else "no phase stands out", n) for p, n in self.phases]
        if named[0][1] / count >= MOSTLY:
            return named[0][0]
        return ", ".join(f"{w} {round(100 * n / count)} %" for w, n in named[:2])

    def words(self) -> str:
        """``rank 3 (intermittent): the slowest in 41 % of the last 500 steps, in 6 spells, the
        longest 80 steps; input wait``."""
        spells = f"{self.spells} spell{'s' if self.spells != 1 else ''}"
        if self.spells == 1:
            spells += f" of {self.longest} steps"
            spells += ", still on" if self.ongoing else f" (steps {self.first}-{self.last})"
        else:
            spells += f", the longest {self.longest} steps"
            spells += ", still on" if self.ongoing else f", the last ended at step {self.last}"
        head = f"rank {self.rank} ({self.kind}):" if self.kind else f"rank {self.rank}:"
        return (
            f"{head} the slowest in {round(100 * self.share)} % of the last {self.span} steps, "
            f"in {spells}; {self.phase_words()}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "kind": self.kind,
            "share": round(self.share, 4),
            "steps": self.steps,
            "span": self.span,
            "spells": self.spells,
            "longest": self.longest,
            "ongoing": self.ongoing,
            "first": self.first,
            "last": self.last,
            "phases": {(PHASE_WORDS.get(p, p) if p else "none"): n for p, n in self.phases},
            "total_steps": self.total_steps,
            "total_spells": self.total_spells,
            "total_longest": self.total_longest,
            "message": self.words(),
        }


class Windowed(Protocol):
    """What the record reads of a job: ``Job`` (every rank's steps, read here) or a job read
    through its nodes' summaries, whose bridges send each rank's medians window by window
    (node_windows.py)."""

    def frontier(self) -> int | None: ...  # the newest step every rank still running reached
    def newest(self) -> int: ...  # the newest step any rank reached
    def first_common(self) -> int | None: ...  # the first step every running rank has
    def judge(self, end: int) -> Window | None: ...  # the window before step ``end``


@dataclass
class StragglerHistory:
    """Fed the job as its steps arrive (``update``); judges each WINDOW of steps once every rank
    still running has passed it. Memory: the last SPAN windows and a Tally per rank ever the
    slowest — bounded however many steps or ranks."""

    recent: deque[Window] = field(default_factory=lambda: deque(maxlen=SPAN))
    tallies: dict[int, Tally] = field(default_factory=dict)
    judged: int = 0  # windows judged since the first
    since: int | None = None  # the first step judged
    _next: int | None = None  # the end of the next window to judge
    _current: int | None = None  # the slowest rank in the latest window

    def update(self, job: Job | Windowed) -> int:
        """Judge every window the ranks have all passed since the last call; how many. A job
        seen first mid-run, or a backlog arriving at once, is judged over its last SPAN windows
        only (a frame's work stays bounded)."""
        judged = _Streams(job) if isinstance(job, Job) else job
        done = judged.frontier()
        if done is None:
            return 0
        ready = (done + 1) // WINDOW * WINDOW  # the end of the newest window every rank passed
        newest = judged.newest()
        if self._next is not None and newest + 1 < self._next - WINDOW:
            # Every rank is back before what was judged: the job restarted (from a checkpoint,
            # or from scratch); judged from there on, its record kept.
            self._next = None
        start = ready - (SPAN - 1) * WINDOW
        if self._next is not None:
            start = max(start, self._next)
        else:
            first = judged.first_common()
            if first is None:
                return 0
            start = max(start, (first // WINDOW + 1) * WINDOW)
        n = 0
        for end in range(start, ready + 1, WINDOW):
            window = judged.judge(end)
            self._next = end + WINDOW
            if window is None:
                continue  # too few steps measured yet (the rule's own minimum): not a verdict
            self._fold(window)
            n += 1
        return n

    def _fold(self, window: Window) -> None:
        if self.since is None:
            self.since = window.end - WINDOW
        self.judged += 1
        self.recent.append(window)
        if self._current is not None and self._current != window.rank:
            self.tallies[self._current].run = 0  # its spell is over
        self._current = window.rank
        if window.rank is None:
            return
        tally = self.tallies.setdefault(window.rank, Tally())
        tally.windows += 1
        tally.spells += tally.run == 0
        tally.run += 1
        tally.longest = max(tally.longest, tally.run)

    # --- what it says ---------------------------------------------------------------------------
    @property
    def span(self) -> int:
        """Steps judged in the recent record."""
        return len(self.recent) * WINDOW

    def records(self) -> list[RankRecord]:
        """Every rank the slowest in some window of the recent span, the most often first."""
        windows = list(self.recent)
        out = []
        for rank in sorted({w.rank for w in windows if w.rank is not None}):
            out.append(self._record(rank, windows))
        return sorted(out, key=lambda r: (-r.steps, r.rank))

    def named(self) -> list[RankRecord]:
        """The ranks whose record says something: a straggler that stays, comes and goes, or did."""
        return [r for r in self.records() if r.kind]

    def _record(self, rank: int, windows: list[Window]) -> RankRecord:
        slow = [w.rank == rank for w in windows]
        runs = _runs(slow)
        phases: dict[str | None, int] = {}
        for w in windows:
            if w.rank == rank:
                phases[w.phase] = phases.get(w.phase, 0) + 1
        ends = [w.end for w in windows if w.rank == rank]
        tally = self.tallies[rank]
        steps = sum(slow) * WINDOW
        record = RankRecord(
            rank=rank,
            kind="",
            span=self.span,
            steps=steps,
            spells=len(runs),
            longest=max(runs) * WINDOW,
            ongoing=slow[-1],
            first=ends[0] - WINDOW,
            last=ends[-1] - 1,
            phases=sorted(phases.items(), key=lambda kv: (-kv[1], kv[0] or "~")),
            total_steps=tally.windows * WINDOW,
            total_spells=tally.spells,
            total_longest=tally.longest * WINDOW,
        )
        return _with_kind(record, len(windows))

    def line(self) -> str:
        """The job's record in one line: the rank named first, or why none is."""
        if len(self.recent) < MIN_JUDGED:
            return (
                f"judged once {MIN_JUDGED * WINDOW} steps are in ({self.span} so far)"
                if self.judged or self._next is None
                else "waiting for steps every rank has measured"
            )
        named = self.named()
        if not named:
            return f"no rank repeatedly the slowest in the last {self.span} steps"
        more = len(named) - 1
        return named[0].words() + (
            f" (and {more} more rank{'s' if more > 1 else ''})" if more else ""
        )

    def whole_run(self, record: RankRecord) -> str:
        """``since step 0: the slowest for 1230 of 8000 steps judged, in 14 spells, the longest
        300 steps`` (the recent span is only the last SPAN windows)."""
        spells = f"{record.total_spells} spell{'s' if record.total_spells != 1 else ''}"
        return (
            f"since step {self.since}: the slowest for {record.total_steps} of "
            f"{self.judged * WINDOW} steps judged, in {spells}, the longest "
            f"{record.total_longest} steps"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "window": WINDOW,
            "span": self.span,
            "judged_steps": self.judged * WINDOW,
            "since_step": self.since,
            "line": self.line(),
            "ranks": [r.to_json() for r in self.records()],
        }


def _with_kind(record: RankRecord, judged: int) -> RankRecord:
    """Named ``persistent`` (still the slowest, or nearly always), ``intermittent`` (several
    spells, gaps between), ``earlier`` (one spell, over); unnamed on too little evidence."""
    if judged < MIN_JUDGED or record.steps < MIN_WINDOWS * WINDOW or record.share < MIN_SHARE:
        kind = ""
    elif record.spells > 1 and record.share < MOST:
        kind = "intermittent"
    elif record.ongoing or record.share >= MOST:
        kind = "persistent"
    else:
        kind = "earlier"
    return RankRecord(**{**record.__dict__, "kind": kind})


def _runs(flags: list[bool]) -> list[int]:
    """The lengths of the runs of True in ``flags``, in order ([0] when there is none)."""
    runs, current = [], 0
    for flag in flags:
        if flag:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs or [0]


@dataclass(frozen=True)
class _Streams:
    """``Job`` as the record reads it: every rank's own steps."""

    job: Job

    def frontier(self) -> int | None:
        return _frontier(self.job)

    def newest(self) -> int:
        return max(_last(s) for s in self.job.ranks.values())

    def first_common(self) -> int | None:
        return _first_common(self.job)

    def judge(self, end: int) -> Window | None:
        return _judge(self.job, end)


def _last(state: RunState) -> int:
    return -1 if state.last_step is None else state.last_step


def _frontier(job: Job) -> int | None:
    """The newest step every rank still running has reached (a rank that ended no longer holds
    the windows back); None with no steps."""
    running = [_last(s) for s in job.ranks.values() if not s.ended]
    if running:
        return min(running)
    return max((_last(s) for s in job.ranks.values()), default=None)


def _first_common(job: Job) -> int | None:
    """The first step every rank running has in its history (a rank seen from mid-run on);
    every rank's, once all have ended (a job read from its recordings)."""
    seen = [s for s in job.ranks.values() if s.n_steps]
    running = [s for s in seen if not s.ended] or seen
    return max((int(s.steps.values[0]) for s in running), default=None)


def _judge(job: Job, end: int) -> Window | None:
    """The window before step ``end`` judged as the live straggler rule judges (job.py): each
    rank's own work a step over its RECENT latest steps there, against the others' median.
    None when fewer than two ranks have enough steps measured."""
    rows = {
        rank: int(np.searchsorted(state.steps.values, end))
        for rank, state in job.ranks.items()
        if _last(state) >= end - 1  # a rank that ended before this window is out of it
    }
    ranks = list(rows)
    whole = _medians([busy_values(job.ranks[r], False, rows[r]) for r in ranks])
    own = _medians([busy_values(job.ranks[r], True, rows[r]) for r in ranks])
    known = [k for k in range(len(ranks)) if np.isfinite(whole[k])]
    return judge_medians(
        end,
        {ranks[k]: float(whole[k]) for k in known},
        {ranks[k]: float(own[k]) if np.isfinite(own[k]) else None for k in known},
        lambda rank, phase: recent_median(job.ranks[rank], phase, rows[rank]),
    )


def judge_medians(
    end: int,
    whole: dict[int, float],
    own: dict[int, float | None],
    phase_of: Callable[[int, str], float | None],
) -> Window | None:
    """The window before ``end`` from each rank's medians there (``whole``: its step time,
    ``own``: its own work; ``phase_of(rank, phase)``: a phase's): the slowest rank, if one
    straggles and not all do, and the phase it spends most over its peers in."""
    measures = compare_busy(whole, own)
    if not measures:
        return None
    slow = [m for m in measures if is_straggling(m, STRAGGLER_RATIO)]
    if not slow or len(slow) == len(measures):
        return Window(end, None, None)
    worst = max(slow, key=lambda m: (m.ratio, -m.rank))
    slow_ranks = {m.rank for m in slow}
    peers = [m.rank for m in measures if m.rank not in slow_ranks]
    peers = peers[:: max(1, len(peers) // PHASE_PEERS)][:PHASE_PEERS]
    return Window(end, worst.rank, _phase(worst.rank, peers, phase_of))


def _phase(rank: int, peers: list[int], phase_of: Callable[[int, str], float | None]) -> str | None:
    """The phase the slow rank spends most over its peers' median (backward left out, as the
    live finding leaves it out: under DDP every rank waits for the slowest inside it)."""
    best, extra = None, 0.0
    for phase in (p for p in PHASES if p != "backward_time"):
        mine = phase_of(rank, phase)
        theirs = [t for r in peers if (t := phase_of(r, phase)) is not None]
        if mine is None or not theirs:
            continue
        diff = mine - float(np.median(theirs))
        if diff > extra:
            best, extra = phase, diff
    return best


def _medians(values: list[np.ndarray]) -> np.ndarray:
    """Each rank's median of its recent values (NaN where fewer than half of RECENT), at once:
    one call over every rank, not one median a rank (~30 µs each, 1,024 of them a window)."""
    table = np.full((len(values), RECENT), np.nan)
    for k, row in enumerate(values):
        table[k, : row.size] = row
    counts = np.isfinite(table).sum(axis=1)
    out = row_medians(table)
    out[counts < RECENT // 2] = np.nan
    return out
