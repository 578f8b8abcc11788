"""A large job seen through its nodes' summaries: the same judgments as ``Job`` (straggler with
phase, divergence with layers, hang with collective and stacks, NaN on some ranks), read from a
few figures a rank and each node's distinct gradient rows, never from the ranks' streams."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tdbg.model.job import (
    DIVERGENCE_RTOL,
    STRAGGLER_RATIO,
    JobFinding,
    Stall,
    StragglerMeasure,
    compare_busy,
    divergence_finding,
    hang_findings,
    is_straggling,
    straggler_finding,
)
from tdbg.model.node_windows import WAIT_WHOLE, NodeWindows, RankWindows
from tdbg.protocol.messages.node_summary import NodeSummary, RankFigures


@dataclass
class NodesJob:
    """Job ``job`` as its nodes last summarised it: each rank's figures, by rank."""

    job: str
    nodes: dict[str, NodeSummary] = field(default_factory=dict)  # node -> its latest summary
    figures: dict[int, RankFigures] = field(default_factory=dict)
    rank_node: dict[int, str] = field(default_factory=dict)
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # layout -> layer names
    lost: dict[str, str] = field(default_factory=dict)  # node -> why its summaries stopped
    windows: RankWindows = field(default_factory=RankWindows)  # the slowest-over-time record's
    # node -> for each of its gradient steps, how many of its ranks have each distinct row:
    # counted once per summary, not per judgement (at 1,024 ranks that was most of its cost).
    _counts: dict[str, list[Counter[int]]] = field(default_factory=dict, repr=False)
    _first_time: float | None = field(default=None, repr=False)  # the first summary's time
    _last_time: float = field(default=0.0, repr=False)  # the newest summary's

    def update(self, node: str, summary: NodeSummary) -> None:
        """``node``'s newest summary replaces its last one (a rank gone from it stays, as the
        last figures it had: a rank that died is named, not forgotten)."""
        self.nodes[node] = summary
        self.lost.pop(node, None)
        if self._first_time is None:
            self._first_time = summary.time
        self._last_time = max(self._last_time, summary.time)
        for figures in summary.ranks:
            self.figures[figures.rank] = figures
            self.rank_node[figures.rank] = node
            self.windows.fold(figures)
        grads = summary.grads
        if grads is not None and grads.names is not None:
            self.names[grads.layout] = grads.names
        if grads is not None:
            # Each step's column of row indices (every rank has one per step: from_wire).
            columns = zip(*grads.which.values(), strict=True)
            self._counts[node] = [Counter(column) for column in columns]

    def node_lost(self, node: str, why: str) -> None:
        """``node``'s bridge stopped answering: its ranks keep their last figures, marked."""
        self.lost[node] = why

    # --- what JobAlerts reads ------------------------------------------------------------------
    def windowed(self) -> NodeWindows:
        """The job as the record of the slowest rank over time reads it."""
        missing = len(self.figures) < self.world_size
        waited = self._last_time - (self._first_time or self._last_time)
        return NodeWindows(
            self.figures, self.rank_node, self.lost, self.windows, missing and waited < WAIT_WHOLE
        )

    @property
    def world_size(self) -> int:
        said = max((s.world for s in self.nodes.values()), default=0)
        return max(said, len(self.figures))

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.figures]

    def rank_steps(self) -> list[int]:
        return [f.step for f in self.figures.values() if f.step is not None]

    def rank_counts(self) -> list[int]:
        return [f.n_steps for f in self.figures.values()]

    def findings(self) -> list[JobFinding]:
        out = list(self.hangs())
        measures = self.straggler_measures()
        slow = [m.rank for m in measures if is_straggling(m, STRAGGLER_RATIO)]
        if slow and len(slow) < len(measures):
            out.extend(self.straggler(rank, slow) for rank in slow)
        out.extend(self.divergences())
        out.extend(self.nonfinite_ranks())
        return out

    # --- stragglers ---------------------------------------------------------------------------
    def straggler_measures(self) -> list[StragglerMeasure]:
        """As ``Job.straggler_measures``, from the medians each rank's node computed."""
        ranks = sorted(self.figures.items())  # kept in arrival order; judged in rank order
        whole = {r: f.whole for r, f in ranks if f.whole is not None and _live(f)}
        own = {r: self.figures[r].own for r in whole}
        return compare_busy(whole, own)

    def straggler(self, rank: int, slow: list[int]) -> JobFinding:
        known = {m.rank: m.busy for m in self.straggler_measures()}
        return straggler_finding(
            rank,
            slow,
            known,
            lambda r, phase: self.figures[r].phases.get(phase),
            self.figures[rank].step,
        )

    # --- hangs --------------------------------------------------------------------------------
    def hangs(self) -> list[JobFinding]:
        stalled = {
            s.rank: Stall(s.seq, s.op, s.sizes, s.group, s.where, s.stack)
            for summary in self.nodes.values()
            for s in summary.stalls
        }
        return hang_findings(stalled)

    # --- diverged ranks ---------------------------------------------------------------------------
    def divergence_rule(self) -> tuple[bool, str]:
        """As ``Job.divergence_rule``: every node's ranks watch one layout, the same on all."""
        if len(self.figures) < 2:
            return False, "one rank seen: nothing to compare"
        grads = [s.grads for s in self._running_nodes().values()]
        if any(g is None for g in grads):
            if all(g is None for g in grads):
                return False, "no layers reported yet (or the ranks watch different layers)"
            return False, (
                "does not apply: some nodes' ranks watch different layers or sizes (FSDP "
                "shards, pipeline or tensor parallelism), or have sampled no step yet"
            )
        layouts = {g.layout for g in grads if g is not None}
        if len(layouts) > 1:
            return False, (
                "does not apply: the ranks watch different layers or sizes (FSDP shards, "
                "pipeline or tensor parallelism), so their gradients are not meant to agree"
            )
        n = len(self.names.get(next(iter(layouts)), ()))
        return True, (
            f"applies: every rank watches the same {n} layer{'s' if n != 1 else ''} "
            "(data parallel): gradients after the all-reduce must agree"
        )

    def divergences(self) -> list[JobFinding]:
        """As ``Job.divergences``: each rank's rows against the median of every rank's at the
        latest steps all sampled. The median is taken over each step's distinct rows weighted
        by how many ranks have each (a healthy job: one row a step, whatever its size)."""
        applies, _ = self.divergence_rule()
        if not applies:
            return []
        grads = {n: s.grads for n, s in self._running_nodes().items() if s.grads is not None}
        layout = next(iter(grads.values())).layout
        names = self.names.get(layout)
        common = sorted(set.intersection(*(set(g.steps) for g in grads.values())))
        if not common or names is None:
            return []
        width = min(len(names), *(len(g.rows[0]) for g in grads.values()))
        bad: dict[int, set[int]] = {}
        diverged: list[int] = []
        for step in common:
            # The step's distinct rows over the job, how many ranks have each, and where.
            table: dict[tuple[float, ...], tuple[list[int], list[tuple[str, int]]]] = {}
            for node, g in grads.items():
                at = g.steps.index(step)
                for idx, count in self._counts[node][at].items():
                    entry = table.setdefault(g.rows[idx][:width], ([0], []))
                    entry[0][0] += count
                    entry[1].append((node, idx))
            rows_ = np.array(list(table), float)
            counts = np.array([n[0] for n, _ in table.values()])
            reference = _weighted_median(rows_, counts)
            with np.errstate(invalid="ignore", divide="ignore"):
                off = np.abs(rows_ - reference) / np.maximum(np.abs(reference), 1e-12)
            off = off > DIVERGENCE_RTOL
            if off.any():
                diverged.append(step)
            for k in np.flatnonzero(off.any(axis=1)):
                layers = [int(i) for i in np.flatnonzero(off[k])]
                for node, idx in list(table.values())[k][1]:
                    for rank, rows in grads[node].which.items():
                        if rows[grads[node].steps.index(step)] == idx:
                            bad.setdefault(rank, set()).update(layers)
        if not bad:
            return []
        named = {r: [names[i] for i in sorted(layers)] for r, layers in bad.items()}
        return [divergence_finding(named, diverged, len(common))]

    def _running_nodes(self) -> dict[str, NodeSummary]:
        """The nodes read now with a live rank (an ended rank's gradient rows stop)."""
        return {
            node: s
            for node, s in self.nodes.items()
            if node not in self.lost and any(_live(f) for f in s.ranks)
        }

    def nonfinite_ranks(self) -> list[JobFinding]:
        bad = sorted(r for r, f in self.figures.items() if f.nonfinite)
        if not bad or len(bad) == len(self.figures):
            return []
        return [
            JobFinding(
                "nonfinite_ranks",
                bad,
                f"non-finite loss on rank{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))} only",
            )
        ]

    def gone(self) -> dict[int, str]:
        """The ranks that ended or died (their state words), and those of lost nodes."""
        out = {r: f.state for r, f in sorted(self.figures.items()) if not _live(f)}
        for rank, node in self.rank_node.items():
            if node in self.lost and rank not in out:
                out[rank] = f"node lost ({self.lost[node]})"
        return out


def _live(figures: RankFigures) -> bool:
    return figures.state in ("live", "stalled")


def _weighted_median(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The per-column median of ``rows`` each repeated ``counts`` times (np.median's: the mean
    of the two middle values for an even total)."""
    total = int(counts.sum())
    order = np.argsort(rows, axis=0, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=0)
    cum = np.cumsum(counts[order], axis=0)  # ranks up to and including each sorted row

    def nth(k: int) -> np.ndarray:  # the k-th smallest (0-based) of the repeated values
        at = (cum > k).argmax(axis=0)
        return ordered[at, np.arange(rows.shape[1])]

    if total % 2:
        return nth(total // 2)
    return (nth(total // 2 - 1) + nth(total // 2)) / 2


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
