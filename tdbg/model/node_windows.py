"""A large job's ranks window by window, as their nodes' bridges sent them: the record of which
rank was the slowest over time (straggler_history) judged from summaries, word for word as from
the ranks' own steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tdbg.model.straggler_history import SPAN, WINDOW, Window, judge_medians
from tdbg.protocol.messages.node_summary import RankFigures, RankWindow

# Windows kept a rank: the record judges a window once every rank has passed it, so a rank
# ahead of the slowest keeps the span and a little more (a rank far ahead is judged late).
KEPT = 2 * SPAN
# Seconds (the bridges' clocks) from the first summary that the record of the slowest rank
# waits for ranks of the job not seen yet before it judges without them (a rank that never
# started). Nodes' first summaries come seconds apart (128 bridges starting on a busy machine:
# a minute), and windows judged before a node's ranks came would lack them for good: a rank
# slow all along was named the slowest in 14 % of them, not 100 %. The windows waited over are
# still judged (the span's), so waiting loses nothing.
WAIT_WHOLE = 120.0


@dataclass
class RankWindows:
    """Each rank's windows (end -> its medians there), the newest KEPT a rank."""

    by_rank: dict[int, dict[int, RankWindow]] = field(default_factory=dict)

    def fold(self, figures: RankFigures) -> None:
        """A summary's new windows of one rank. Windows from before the newest one held mean
        the rank restarted (or a new bridge sent its backlog again): its windows start over."""
        if not figures.windows:
            return
        mine = self.by_rank.setdefault(figures.rank, {})
        if mine and figures.windows[0].end <= max(mine):
            mine.clear()
        for window in figures.windows:
            mine[window.end] = window
        if len(mine) > KEPT:
            for end in sorted(mine)[: len(mine) - KEPT]:
                del mine[end]


@dataclass(frozen=True)
class NodeWindows:
    """A job's summaries (``NodesJob``'s fields) as the record of the slowest rank reads them
    (straggler_history.Windowed): a rank whose node is lost, or that ended, no longer holds the
    windows back."""

    figures: dict[int, RankFigures]  # rank -> its latest figures
    rank_node: dict[int, str]
    lost: dict[str, str]  # the nodes not read
    windows: RankWindows
    # Ranks of the job's world not seen yet, within WAIT_WHOLE seconds of the first summary:
    # the record does not start (NodesJob.windowed).
    waiting: bool = False

    def _running(self) -> list[RankFigures]:
        return [
            f
            for f in self.figures.values()
            if f.state in ("live", "stalled") and self.rank_node.get(f.rank) not in self.lost
        ]

    def frontier(self) -> int | None:
        running = [_step(f) for f in self._running()]
        if running:
            return min(running)
        return max((_step(f) for f in self.figures.values()), default=None)

    def newest(self) -> int:
        return max((_step(f) for f in self.figures.values()), default=-1)

    def first_common(self) -> int | None:
        """The step before the first window every running rank was sent (all ranks', once
        none runs): the record starts at that window, as from the ranks' own steps. None (not
        yet) while ``waiting`` for ranks of the job not seen yet."""
        if self.waiting:
            return None
        store = self.windows.by_rank
        running = [f.rank for f in self._running() if store.get(f.rank)]
        ranks = running or [r for r in self.figures if store.get(r)]
        return max((min(store[r]) - 1 for r in ranks), default=None)

    def judge(self, end: int) -> Window | None:
        store = self.windows.by_rank
        at: dict[int, RankWindow] = {}
        for rank, f in self.figures.items():
            window = store.get(rank, {}).get(end)
            if _step(f) >= end - 1 and window is not None:  # it ran through this window
                at[rank] = window
        whole = {
            r: w.whole for r, w in at.items() if w.whole is not None and math.isfinite(w.whole)
        }
        own = {r: at[r].own for r in whole}
        return judge_medians(end, whole, own, lambda rank, phase: at[rank].phases.get(phase))


def _step(f: RankFigures) -> int:
    return -1 if f.step is None else f.step


__all__ = ["KEPT", "WINDOW", "NodeWindows", "RankWindows"]
