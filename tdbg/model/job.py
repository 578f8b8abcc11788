"""A distributed job seen whole: its ranks' states compared — stragglers, diverged ranks, NaN on
some ranks only. Everything is compared here, outside the training processes (no collective)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tdbg.model.health import open_stall
from tdbg.model.medians import median
from tdbg.model.run_state import RunState
from tdbg.model.unwatched import UNWATCHED_AFTER, unwatched
from tdbg.protocol.steps import MAX_PHASE_GAP, PHASE_WORDS, PHASES

RECENT = 20  # steps a straggler is judged over
STRAGGLER_RATIO = 1.25  # a rank this much slower than the others' median...
STRAGGLER_MIN_SECONDS = 0.002  # ...and at least this much slower per step (noise on tiny steps)
DIVERGENCE_RTOL = 1e-3  # DDP: the all-reduced gradients agree to this relative tolerance


@dataclass(frozen=True)
class JobFinding:
    kind: str  # "straggler" | "rank_divergence" | "nonfinite_ranks" | "hang"
    ranks: list[int]
    message: str
    layers: list[str] = field(default_factory=list)
    step: int | None = None  # rank_divergence: the first step found; straggler: latest step
    phase: str | None = None  # straggler: the step column that explains it (run_state.ANATOMY)
    slower_by: float | None = None  # straggler: seconds of own work a step over the others
    collective: dict[str, Any] | None = None  # hang: {seq, op, sizes, group} the others wait in
    stacks: dict[int, str] = field(default_factory=dict)  # hang: rank -> its training stack


@dataclass(frozen=True)
class StragglerMeasure:
    """One rank's own work per step (median of the recent steps) against the other ranks'."""

    rank: int
    busy: float  # seconds of own work a step (the step less its backward)
    typical: float  # the other ranks' median of the same

    @property
    def ratio(self) -> float:
        return self.busy / self.typical if self.typical > 0 else math.inf

    @property
    def slower_by(self) -> float:
        return self.busy - self.typical


@dataclass
class Job:
    """The ranks of one job (same job id), by rank."""

    job: str
    ranks: dict[int, RunState]
    # (figure, rank) -> (the rank's state, its steps_revision, the figure): the recent medians
    # are read many times a judgement and a frame, and change only when the rank's steps do.
    _memo: dict[tuple[str, int], tuple[RunState, int, float | None]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def _memoized(
        self, figure: str, state: RunState, compute: Callable[[], float | None]
    ) -> float | None:
        key = (figure, int(state.run.get("rank") or 0))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is state and hit[1] == state.steps_revision:
            return hit[2]
        value = compute()
        self._memo[key] = (state, state.steps_revision, value)
        return value

    @staticmethod
    def group(states: list[RunState]) -> tuple[list[Job], list[RunState]]:
        """Jobs (runs that share a job id and have a world size) and the single runs left."""
        jobs: dict[str, dict[int, RunState]] = {}
        single: list[RunState] = []
        for state in states:
            job = str(state.run.get("job") or "")
            if not job or not isinstance(state.run.get("world_size"), int):
                single.append(state)
                continue
            jobs.setdefault(job, {})[int(state.run.get("rank") or 0)] = state
        return [Job(job, dict(sorted(r.items()))) for job, r in jobs.items()], single

    @property
    def world_size(self) -> int:
        sizes = [s.run.get("world_size") for s in self.ranks.values()]
        return max((int(w) for w in sizes if isinstance(w, int)), default=len(self.ranks))

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.ranks]

    def unwatched_line(self, now: float) -> str | None:
        """Under `tdbg run` (its ranks name what started them), the ranks still missing
        UNWATCHED_AFTER seconds after the first rank's probe started, as `tdbg run` says them
        on stderr; None otherwise (a rank starting late is not yet said unwatched)."""
        missing = self.missing_ranks()
        names = [s.run.get("launcher") for s in self.ranks.values()]
        launcher = next((n for n in names if isinstance(n, str) and n), None)
        starts = [s.run.get("start_time") for s in self.ranks.values()]
        first = min((t for t in starts if isinstance(t, int | float)), default=now)
        if not missing or launcher is None or now - first < UNWATCHED_AFTER:
            return None
        return unwatched(missing, self.world_size, launcher)

    def rank_steps(self) -> list[int]:
        return [s.last_step for s in self.ranks.values() if s.last_step is not None]

    def rank_counts(self) -> list[int]:
        return [s.n_steps for s in self.ranks.values()]

    def findings(self) -> list[JobFinding]:
        out: list[JobFinding] = list(self.hangs())
        out.extend(self._stragglers())
        out.extend(self.divergences())
        out.extend(self.nonfinite_ranks())
        return out

    # --- where a hang is stuck ---------------------------------------------------------------
    def hangs(self) -> list[JobFinding]:
        """Stalled ranks' last collectives compared, within each process group (sequence
        numbers count per group): the others wait in collective #N; the ranks whose last is
        below N never entered it, and their stacks say where they are."""
        stalled = {r: st for r, s in self.ranks.items() if (st := still_stalled(s)) is not None}
        return hang_findings(stalled)

    # --- stragglers ---------------------------------------------------------------------------
    def _recent(self, state: RunState, column: str) -> float | None:
        return self._memoized(column, state, lambda: recent_median(state, column))

    def _busy(self, state: RunState, own: bool) -> float | None:
        figure = "busy" if own else "step"
        return self._memoized(figure, state, lambda: busy_median(state, own))

    def straggler_measures(self) -> list[StragglerMeasure]:
        """Each rank's own work a step against the median of the others' (two or more ranks
        with enough recent steps; [] otherwise). One measure for the whole job: its step less
        its backward where every rank has enough steps with a timed backward, else the step's
        time (never one rank's against another's of the other kind)."""
        whole = {r: t for r, s in self.ranks.items() if (t := self._busy(s, False)) is not None}
        own = {r: self._busy(self.ranks[r], True) for r in whole}
        return compare_busy(whole, own)

    def _stragglers(self) -> list[JobFinding]:
        measures = self.straggler_measures()
        slow = [m.rank for m in measures if is_straggling(m, STRAGGLER_RATIO)]
        if not slow or len(slow) == len(measures):
            return []
        return [self.straggler(rank, slow) for rank in slow]

    def straggler(self, rank: int, slow: list[int]) -> JobFinding:
        """The finding for ``rank``, one of the ``slow`` ranks: by how much, and why."""
        known = {m.rank: m.busy for m in self.straggler_measures()}
        return straggler_finding(
            rank,
            slow,
            known,
            lambda r, phase: self._recent(self.ranks[r], phase),
            self.ranks[rank].last_step,
        )

    # --- diverged ranks -------------------------------------------------------------------------
    def data_parallel(self) -> bool:
        """Whether the rule 'every rank has the same gradients' applies: every rank watches the
        same layers with the same sizes (DDP). FSDP shards and model parallelism differ."""
        return self.divergence_rule()[0]

    def divergence_rule(self) -> tuple[bool, str]:
        """Whether the 'equal gradients on every rank' rule applies to this job, and why."""
        if len(self.ranks) < 2:
            return False, "one rank seen: nothing to compare"
        layouts = {(tuple(s.layer_names), tuple(s.layer_numel)) for s in self.ranks.values()}
        if not next(iter(layouts))[0] and len(layouts) == 1:
            return False, "no layers reported yet"
        if len(layouts) > 1:
            return False, (
                "does not apply: the ranks watch different layers or sizes (FSDP shards, "
                "pipeline or tensor parallelism), so their gradients are not meant to agree"
            )
        n = len(next(iter(layouts))[0])
        return True, (
            f"applies: every rank watches the same {n} layer{'s' if n != 1 else ''} "
            "(data parallel): gradients after the all-reduce must agree"
        )

    def divergences(self) -> list[JobFinding]:
        if not self.data_parallel():
            return []
        rows = {r: grad_rows(s) for r, s in self.ranks.items()}
        common = sorted(set.intersection(*(set(rows[r]) for r in rows)))
        if not common:
            return []
        names = next(iter(self.ranks.values())).layer_names
        ranks = list(rows)
        width = min(len(names), *(len(rows[r][s]) for r in ranks for s in common))
        # One array (rank, step, layer) compared at once: the per-rank, per-step Python loop
        # cost ~40 ms a judgement at 64 ranks.
        cube = np.stack([np.stack([rows[r][s][:width] for s in common]) for r in ranks])
        reference = np.median(cube, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            off = np.abs(cube - reference) / np.maximum(np.abs(reference), 1e-12) > DIVERGENCE_RTOL
        bad = {
            r: [names[i] for i in np.flatnonzero(off[k].any(axis=0))]
            for k, r in enumerate(ranks)
            if off[k].any()
        }
        diverged = [s for j, s in enumerate(common) if off[:, j, :].any()]
        if not bad:
            return []
        return [divergence_finding(bad, diverged, len(common))]

    def nonfinite_ranks(self) -> list[JobFinding]:
        bad = [r for r, s in self.ranks.items() if s.diverged]
        if not bad or len(bad) == len(self.ranks):
            return []
        return [
            JobFinding(
                "nonfinite_ranks",
                bad,
                f"non-finite loss on rank{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))} only",
            )
        ]


def straggler_finding(
    rank: int,
    slow: list[int],
    known: dict[int, float],
    phase_of: Callable[[int, str], float | None],
    step: int | None,
) -> JobFinding:
    """The straggler finding for ``rank``, one of the ``slow`` ranks, from each rank's own work
    a step (``known``) and its phases' recent medians (``phase_of(rank, phase)``)."""
    peers = [r for r in known if r not in slow] or [r for r in known if r != rank]
    typical = float(np.median([known[r] for r in peers]))
    best, extra = None, 0.0
    # Not backward: under DDP it holds the gradient all-reduce, where every rank waits for the
    # slowest one, so the ranks' backward times say little about who is slow.
    for phase in (p for p in PHASES if p != "backward_time"):
        mine = phase_of(rank, phase)
        theirs = [t for r in peers if (t := phase_of(r, phase)) is not None]
        if mine is None or not theirs:
            continue
        diff = mine - float(np.median(theirs))
        if diff > extra:
            best, extra = phase, diff
    because = f"; mostly {PHASE_WORDS[best]} (+{extra * 1e3:.1f} ms)" if best else ""
    mine_busy = known.get(rank, math.nan)
    return JobFinding(
        "straggler",
        [rank],
        f"rank {rank} holds the others up: {mine_busy * 1e3:.1f} ms of its own "
        f"work a step vs {typical * 1e3:.1f} ms on the others{because}",
        step=step,
        phase=best,
        slower_by=mine_busy - typical,
    )


def divergence_finding(bad: dict[int, list[str]], diverged: list[int], common: int) -> JobFinding:
    """The divergence finding: ``bad`` ranks and the layers each differs in, at the ``diverged``
    steps of the ``common`` latest steps every rank sampled. With two ranks (or most ranks off
    the median) there is no majority to blame: every rank that disagrees is named."""
    layers = sorted({name for names_ in bad.values() for name in names_})
    ranks = sorted(bad)
    shown = ", ".join(layers[:5]) + (f" (+{len(layers) - 5})" if len(layers) > 5 else "")
    shown = f"layer{'s' if len(layers) > 1 else ''} {shown}"  # "in layer 2", not "in 2"
    return JobFinding(
        "rank_divergence",
        ranks,
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: gradients "
        f"differ from the other ranks' in {shown} at {len(diverged)} of the "
        f"{common} latest steps all ranks sampled (first: step {diverged[0]}) — under data "
        "parallelism they should be equal after the all-reduce (a skipped all-reduce, "
        "a comm hook, other weights?)",
        layers,
        step=diverged[0],
    )


def rank_list(ranks: list[int], spelled: int = 8) -> str:
    """``ranks`` (sorted) as a message says them: each one up to ``spelled`` of them, else runs
    of consecutive ranks as ranges (``0-41, 43-1023``: a hang in a 1,024-rank job names the
    ranks that wait in a line, not in 1,023 numbers)."""
    if len(ranks) <= spelled:
        return ", ".join(map(str, ranks))
    runs: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ", ".join(runs)


def hang_findings(stalled: dict[int, Stall]) -> list[JobFinding]:
    """The hangs among the stalled ranks' last collectives (``Job.hangs``), per process group."""
    by_group: dict[str, dict[int, Stall]] = {}
    for rank, stall in stalled.items():
        by_group.setdefault(stall.group, {})[rank] = stall
    out = []
    for group, last in sorted(by_group.items()):
        if len(last) < 2:
            continue
        top = max(s.seq for s in last.values())
        behind = sorted(r for r, s in last.items() if s.seq < top)
        waiting = sorted(r for r, s in last.items() if s.seq == top)
        if not behind:
            continue
        waited = last[waiting[0]]
        where = "; ".join(f"rank {r} stuck at {last[r].where}" for r in behind if last[r].where)
        out.append(
            JobFinding(
                "hang",
                behind,
                f"rank{'s' if len(behind) > 1 else ''} {rank_list(behind)} never "
                f"entered collective #{top} ({waited.op}) that rank"
                f"{'s' if len(waiting) > 1 else ''} {rank_list(waiting)} "
                f"wait{'' if len(waiting) > 1 else 's'} in" + (f"; {where}" if where else ""),
                collective={"seq": top, "op": waited.op, "sizes": waited.sizes, "group": group},
                stacks={r: last[r].stack for r in sorted(last)},
            )
        )
    return out


def compare_busy(whole: dict[int, float], own: dict[int, float | None]) -> list[StragglerMeasure]:
    """Each rank's time a step against the median of the others' (``Job.straggler_measures``):
    its own work where every rank in ``whole`` has it in ``own``, else the step's time."""
    known = whole if None in own.values() else {r: t for r, t in own.items() if t is not None}
    if len(known) < 2:
        return []
    typical = others_medians(np.fromiter(known.values(), float, len(known)))
    return [
        StragglerMeasure(rank, t, float(m))
        for (rank, t), m in zip(known.items(), typical, strict=True)
    ]


def others_medians(values: np.ndarray) -> np.ndarray:
    """For each value, the median of all the other values (two or more): read off one sort,
    not a median of n - 1 values per value (at 1,024 ranks that took ~140 ms a judgement)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    at = np.empty(len(values), dtype=np.intp)
    at[order] = np.arange(len(values))  # each value's place in ``ordered``
    left = len(values) - 1  # how many others

    def others(k: int) -> np.ndarray:
        # The k-th smallest of the others: ordered[k], or the next one where the value itself
        # sits at or before k.
        return ordered[np.where(at <= k, k + 1, k)]

    if left % 2:
        return others(left // 2)
    return (others(left // 2 - 1) + others(left // 2)) / 2


def is_straggling(measure: StragglerMeasure, ratio: float) -> bool:
    """Slower than the others by ``ratio`` and by enough time to matter (not noise on tiny
    steps)."""
    return measure.ratio > ratio and measure.slower_by > STRAGGLER_MIN_SECONDS


@dataclass(frozen=True)
class Stall:
    """A rank's newest ``stalled`` alert, still unresolved, with its last collective."""

    seq: int
    op: str
    sizes: Any
    group: str
    where: str
    stack: str


def still_stalled(state: RunState) -> Stall | None:
    """The rank's open stall (the one rule: health.open_stall), when it names a collective."""
    latest = open_stall(state)
    if latest is None or not latest.collective:
        return None
    collective = latest.collective
    seq = collective.get("seq")
    if not isinstance(seq, int):
        return None
    group = collective.get("group")
    return Stall(
        seq=seq,
        op=str(collective.get("op") or "collective"),
        sizes=collective.get("sizes"),
        group=str(group[0] if isinstance(group, list | tuple) and group else group or "default"),
        where=latest.where or "",
        stack="\n".join(latest.stack),
    )


def grad_rows(state: RunState) -> dict[int, np.ndarray]:
    """The newest sampled per-layer rows, by step (enough to find a step every rank sampled)."""
    steps, rows = state.grads.recent_steps(RECENT), state.grads.recent(RECENT)
    return {int(step): row for step, row in zip(steps, rows, strict=True)}


def median_of_enough(values: np.ndarray) -> float | None:
    """The median of a rank's recent values, when there are at least half of RECENT of them."""
    return median(values) if values.size >= RECENT // 2 else None


def recent_median(state: RunState, column: str, end: int | None = None) -> float | None:
    """The median of the last RECENT steps that measured ``column`` (``recent_values``)."""
    return median_of_enough(recent_values(state, column, end))


def recent_values(state: RunState, column: str, end: int | None = None) -> np.ndarray:
    """The last RECENT steps' values of ``column`` that were measured (a GPU run with short
    steps times the phases of one step in a few); ``end``: among the rows before that one (a
    past moment of the run), else the newest."""
    col = state.cols[column].values[:end][-RECENT * MAX_PHASE_GAP :]
    return col[np.isfinite(col)][-RECENT:]


def busy_median(state: RunState, own: bool, end: int | None = None) -> float | None:
    """A rank's time per step (``busy_values``); None with too few steps measured."""
    return median_of_enough(busy_values(state, own, end))


def busy_values(state: RunState, own: bool, end: int | None = None) -> np.ndarray:
    """A rank's recent times per step. ``own``: its own work, the step less its backward, over
    the recent steps whose backward was timed (on a GPU run with short steps one in a few).
    Under data parallelism the ranks wait for each other inside backward (the all-reduce), so
    their step times are equal; what the straggler spends elsewhere (waiting for data, a slow
    forward) the others spend waiting in backward. Else the step's time (where no optimizer
    hook marks the backward's end). ``end``: as at that row (the rows before it), else now."""
    if not own:
        step = state.cols["step_time"].values[:end][-RECENT:]
        return step[np.isfinite(step)]
    lookback = RECENT * MAX_PHASE_GAP
    step = state.cols["step_time"].values[:end][-lookback:]
    backward = state.cols["backward_time"].values[:end][-lookback:]
    timed = np.isfinite(backward) & np.isfinite(step)
    return (step[timed] - backward[timed])[-RECENT:]
