"""One job's per-rank profiles compared: the slowest and fastest rank, and their ops by name.

Plain Python over the protocol's profile result (no textual, no rich), for ``tdbg profile --job``
and the job screen alike.

Which rank is slow is not read from wall time alone: under DDP the ranks run in lockstep (every
step ends in an all-reduce), so every rank's profiled steps last as long as the slowest rank's,
and the fast ranks spend the difference waiting in the collective. A rank's *own* time is its
wall time less the time it spent in collectives (the ``gloo:``/``nccl:`` ops); the straggler is
the rank with the most own time per step, the one the others wait for. With no collective in
the profile, own time is wall time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tdbg.format import fmt_seconds, fmt_us
from tdbg.protocol.messages.results import ProfileResult, ProfileRow

EMPTY_PROFILE = ProfileResult.of_ops([], device=False)  # what a rank's malformed result reads as

# The record_function names c10d gives its collectives' work, one per backend.
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "xccl:")
# The ops that wrap a collective (c10d::allreduce_ ...): waiting on the other ranks too.
COLLECTIVE_WRAPPERS = ("c10d::",)


def waits_for_others(op: str) -> bool:
    """Whether time in ``op`` is (mostly) waiting for the other ranks: a collective."""
    return op.startswith(COLLECTIVE_PREFIXES + COLLECTIVE_WRAPPERS)


@dataclass(frozen=True)
class RankProfile:
    """One rank's profile, per profiled step."""

    rank: int
    profile: ProfileResult
    steps: int  # steps profiled
    wall: float | None  # seconds per step, None when the probe did not say
    waited: float  # seconds per step inside collectives (at most ``wall``)

    @property
    def own(self) -> float | None:
        """Seconds per step this rank spent outside collectives."""
        return None if self.wall is None else self.wall - self.waited

    @property
    def column(self) -> str:
        """The time column compared: device total on device runs, else CPU total."""
        return self.profile.sort

    def per_step(self, row: ProfileRow | None) -> float | None:
        """A row's compared time per step, in microseconds."""
        if row is None:
            return None
        value = _time(row, self.column)
        return None if value is None else value / self.steps


def _time(row: ProfileRow, column: str) -> float | None:
    """A row's time column (``cpu_total``, ``device_total``...) in microseconds."""
    return row.value(column)


def rank_profile(rank: int, result: Any) -> RankProfile:
    """A rank's profile result read and reduced to per-step figures."""
    # As a rank's model read it (the TUI), or as the wire sent it (``tdbg profile --job``).
    if isinstance(result, ProfileResult):
        profile = result
    else:
        profile = ProfileResult.from_wire(result) or EMPTY_PROFILE
    span = profile.steps
    steps = max(1, span[1] - span[0] + 1) if span else 1
    wall = profile.wall_seconds
    column = profile.sort
    waited_us = sum(
        _time(row, column) or 0.0
        for row in profile.rows
        if row.name.startswith(COLLECTIVE_PREFIXES)
    )
    waited = waited_us / 1e6 / steps
    per_step_wall = None if wall is None else wall / steps
    if per_step_wall is not None:
        waited = min(waited, per_step_wall)
    return RankProfile(rank, profile, steps, per_step_wall, waited)


def rank_line(p: RankProfile, wall: bool = True) -> str:
    """``rank 1: steps 61-65, 0.215 s wall, 41.6ms/step own, 1.4ms/step in collectives``
    (without the wall time where a line must fit 80 columns)."""
    steps = p.profile.steps
    span = f"{steps[0]}-{steps[1]}" if steps else "?-?"
    own = "?" if p.own is None else fmt_us(p.own * 1e6)
    walled = f" {fmt_seconds(p.profile.wall_seconds)} wall," if wall else ""
    return (
        f"rank {p.rank}: steps {span},{walled} {own}/step own, "
        f"{fmt_us(p.waited * 1e6)}/step in collectives"
    )


@dataclass(frozen=True)
class OpPair:
    """One op in the slowest and the fastest rank's profiles (None: not among its rows)."""

    name: str
    slow: ProfileRow | None
    fast: ProfileRow | None
    slow_us: float | None  # compared time per step
    fast_us: float | None

    @property
    def difference(self) -> float:
        """Slowest minus fastest, microseconds per step (an op missing on one side counts 0)."""
        return (self.slow_us or 0.0) - (self.fast_us or 0.0)

    @property
    def difference_text(self) -> str:
        """The difference signed: ``+40.1ms``, ``-120us``."""
        return ("+" if self.difference > 0 else "") + fmt_us(self.difference)


@dataclass(frozen=True)
class ProfileComparison:
    """The ranks slowest first; the slowest and fastest rank's top ops aligned by name."""

    ranks: list[RankProfile]  # by own time per step, slowest first
    ops: list[OpPair]  # by the larger of the two times, largest first

    @property
    def slowest(self) -> RankProfile:
        return self.ranks[0]

    @property
    def fastest(self) -> RankProfile:
        return self.ranks[-1]

    @property
    def others(self) -> list[RankProfile]:
        return self.ranks[1:-1]

    def biggest_difference(self) -> OpPair | None:
        """The op of the ranks' own work whose time differs most between the two ranks (None:
        one rank only). Collectives are left out: a fast rank's extra time in all_reduce is its
        wait for the slow one, the effect rather than the cause."""
        own = [op for op in self.ops if not waits_for_others(op.name)]
        if len(self.ranks) < 2 or not own:
            return None
        return max(own, key=lambda op: (abs(op.difference), op.name))

    def biggest_difference_line(self) -> str | None:
        """``biggest difference in own work: OP, 40µs/step more on rank 1 than on rank 0`` (None:
        no pair)."""
        biggest = self.biggest_difference()
        if biggest is None:
            return None
        more, less = (
            (self.slowest, self.fastest) if biggest.difference > 0 else (self.fastest, self.slowest)
        )
        return (
            f"biggest difference in own work: {biggest.name}, "
            f"{fmt_us(abs(biggest.difference))}/step more on rank {more.rank} than on rank "
            f"{less.rank}"
        )


def compare_profiles(results: Mapping[int, Any], limit: int = 20) -> ProfileComparison | None:
    """Compare profile results by rank; None when there is none. Ranks whose wall time is
    unknown come last (they cannot be placed); ties go to the lower rank first."""
    if not results:
        return None
    ranks = [rank_profile(rank, result) for rank, result in sorted(results.items())]
    ranks.sort(key=lambda p: (p.own is None, -(p.own or 0.0), p.rank))
    slow, fast = ranks[0], ranks[-1]
    names: list[str] = []
    for side in (slow, fast):
        for row in side.profile.rows[:limit]:
            if row.name not in names:
                names.append(row.name)
    slow_rows = {row.name: row for row in slow.profile.rows}
    fast_rows = {row.name: row for row in fast.profile.rows}
    ops = [
        OpPair(
            name,
            slow_rows.get(name),
            fast_rows.get(name),
            slow.per_step(slow_rows.get(name)),
            fast.per_step(fast_rows.get(name)),
        )
        for name in names
    ]
    ops.sort(key=lambda op: (-max(op.slow_us or 0.0, op.fast_us or 0.0), op.name))
    return ProfileComparison(ranks, ops[:limit])
