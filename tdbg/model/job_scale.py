"""The job screen's figures at scale, from node summaries: the worst ranks, the spread of step
time, loss and gradient norm with the outliers named, and one row per node."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.job_table import SEVERITY_ORDER, SLOWER_THAN_TYPICAL, RankRow
from tdbg.protocol.messages.node_summary import RankFigures

WORST_SHOWN = 12  # rows of the worst-ranks table (a node's ranks when one node is opened)
OUTLIERS_NAMED = 3  # outliers named per measure; the rest counted
FENCE = 3.0  # an outlier lies this many interquartile ranges beyond the quartiles...
MIN_SPREAD = 0.02  # ...and this share of the median away from it (identical ranks: none)

# The measures whose spread is shown: name, how a rank's figure is read, unit
MEASURES: tuple[tuple[str, Callable[[RankFigures], float | None], str], ...] = (
    ("step time", lambda f: f.whole, "s"),
    ("own work", lambda f: f.own, "s"),
    ("loss", lambda f: f.loss, ""),
    ("grad norm", lambda f: f.grad, ""),
)


@dataclass(frozen=True)
class Spread:
    """One measure over the ranks: its quantiles (min, p25, median, p75, max), the outliers
    (rank, value) farthest first, and how many ranks measured it."""

    name: str
    unit: str
    quantiles: tuple[float, ...] | None
    outliers: list[tuple[int, float]]
    count: int
    nonfinite: list[int]  # ranks whose figure is NaN or inf (always outliers)


def spread(name: str, unit: str, values: dict[int, float | None]) -> Spread:
    """``values`` (rank -> figure) as a spread; outliers beyond FENCE interquartile ranges."""
    known = {r: v for r, v in values.items() if v is not None}
    bad = sorted(r for r, v in known.items() if not math.isfinite(v))
    finite = {r: v for r, v in known.items() if math.isfinite(v)}
    if not finite:
        return Spread(name, unit, None, [], 0, bad)
    ranks = np.fromiter(finite.keys(), int, len(finite))
    arr = np.fromiter(finite.values(), float, len(finite))
    q = np.quantile(arr, (0.0, 0.25, 0.5, 0.75, 1.0))
    iqr = q[3] - q[1]
    margin = max(FENCE * iqr, MIN_SPREAD * abs(q[2]))
    far = np.maximum(arr - (q[3] + margin), (q[1] - margin) - arr)
    order = np.argsort(-far, kind="stable")
    outliers = [(int(ranks[i]), float(arr[i])) for i in order if far[i] > 0]
    return Spread(name, unit, tuple(float(x) for x in q), outliers, len(finite), bad)


def spreads(nodes: NodesJob) -> list[Spread]:
    """Each of MEASURES over the live ranks."""
    live = [f for f in nodes.figures.values() if f.state in ("live", "stalled")]
    return [spread(name, unit, {f.rank: read(f) for f in live}) for name, read, unit in MEASURES]


def rank_row(nodes: NodesJob, f: RankFigures, alerts: list[str]) -> RankRow:
    """A rank's summary as a row of the rank table (medians of its recent steps)."""
    node = nodes.rank_node.get(f.rank, "?")
    state = f.state
    if node in nodes.lost and state in ("live", "stalled"):
        state = "node lost"
    return RankRow(
        rank=f.rank,
        node=node,  # as the viewer named it (ssh: as you wrote it), not the host's own name
        step=f.step,
        step_time=f.whole,
        data_time=f.phases.get("data_time"),
        forward_time=f.phases.get("forward_time"),
        backward_time=f.phases.get("backward_time"),
        optimizer_time=f.phases.get("optimizer_time"),
        loss=f.loss,
        grad_total=f.grad,
        # As the per-rank table: the CUDA allocator's peak on a GPU, else the process's RSS.
        memory=f.peak if f.peak is not None else f.rss,
        gpu_util=f.gpu_util,
        on_gpu=f.on_gpu,
        alerts=alerts,
        state=state,
    )


def worst_rows(
    nodes: NodesJob,
    alerts: JobAlerts,
    node: str | None = None,
    shown: int = WORST_SHOWN,
    spread_: list[Spread] | None = None,
) -> list[RankRow]:
    """The ``shown`` worst ranks (of ``node``'s, or of the job): ranks with job alerts (a hang,
    then divergence, then a straggler), then ranks that ended or stalled, then outliers of loss
    and gradient norm, then ranks over 5 % slower than the median own work, slowest first; the
    rest in rank order. Each row's alerts column also says why it is here."""
    flagged = alerts.ranks_alerted()
    figures = nodes.figures
    if node is not None:
        figures = {r: f for r, f in figures.items() if nodes.rank_node.get(r) == node}
    busy = {r: f.own if f.own is not None else f.whole for r, f in figures.items()}
    known = [b for b in busy.values() if b is not None]
    typical = float(np.median(known)) if known else 0.0
    odd: dict[int, list[str]] = {}
    for s in spreads(nodes) if spread_ is None else spread_:
        if s.name in ("loss", "grad norm"):
            for rank, _ in s.outliers:
                odd.setdefault(rank, []).append(f"{s.name} outlier")
            for rank in s.nonfinite:
                odd.setdefault(rank, []).append(f"{s.name} non-finite")

    def badness(f: RankFigures) -> tuple[float, int, int, float, int]:
        kinds = flagged.get(f.rank, [])
        worst_alert = min((SEVERITY_ORDER.get(k, 3) for k in kinds), default=9)
        trouble = 0 if f.state not in ("live",) or nodes.rank_node.get(f.rank) in nodes.lost else 1
        own = busy.get(f.rank) or 0.0
        slow = own if own > typical * SLOWER_THAN_TYPICAL else 0.0
        return (worst_alert, trouble, 0 if f.rank in odd else 1, -slow, f.rank)

    chosen = sorted(figures.values(), key=badness)[:shown]
    rows = []
    for f in chosen:
        row = rank_row(nodes, f, [])
        # Why the rank is here: its job alerts, its state when not live, its outliers.
        tags = sorted(flagged.get(f.rank, []), key=lambda k: SEVERITY_ORDER.get(k, 3))
        tags += ([] if row.state == "live" else [row.state]) + odd.get(f.rank, [])
        rows.append(replace(row, alerts=tags))
    return rows


@dataclass(frozen=True)
class NodeRow:
    node: str
    host: str
    ranks: int
    step_lo: int | None
    step_hi: int | None
    step_time: float | None  # the median over its ranks of their median step time
    slowest: tuple[int, float] | None  # its rank with the most own work a step, and that
    trouble: int  # its ranks with job alerts, ended, dead or stalled
    lost: str | None = None  # why its bridge is not read, when it is not


def node_rows(nodes: NodesJob, alerts: JobAlerts) -> list[NodeRow]:
    """One row per node: nodes not read first, then by how many of their ranks are in trouble,
    then those whose slowest rank is over 5 % slower than the job's median, then by name (an
    order that does not shuffle on noise: the table is rewritten only where it changed)."""
    flagged = alerts.ranks_alerted()
    rows = []
    for name, summary in nodes.nodes.items():
        mine = [nodes.figures[f.rank] for f in summary.ranks if f.rank in nodes.figures]
        steps = [f.step for f in mine if f.step is not None]
        whole = summary.quantiles("whole")
        busy = [(f.rank, b) for f in mine if (b := f.own if f.own is not None else f.whole)]
        trouble = sum(1 for f in mine if f.state != "live" or f.rank in flagged)
        rows.append(
            NodeRow(
                node=name,
                host=summary.host,
                ranks=len(mine),
                step_lo=min(steps) if steps else None,
                step_hi=max(steps) if steps else None,
                step_time=whole[2] if whole else None,
                slowest=max(busy, key=lambda rb: rb[1]) if busy else None,
                trouble=trouble,
                lost=nodes.lost.get(name),
            )
        )
    slowest = [r.slowest[1] for r in rows if r.slowest is not None]
    typical = float(np.median(slowest)) if slowest else 0.0

    def slow(r: NodeRow) -> float:
        own = r.slowest[1] if r.slowest is not None else 0.0
        return own if own > typical * SLOWER_THAN_TYPICAL else 0.0

    return sorted(rows, key=lambda r: (0 if r.lost else 1, -r.trouble, -slow(r), r.node))
