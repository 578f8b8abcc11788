"""One node's ranks reduced to a ``summary`` (what ``tdbg bridge --job --summaries`` sends)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tdbg.model.job import RECENT, grad_rows, still_stalled
from tdbg.model.node_figures import FigureCache, rank_figures, rank_windows
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.node_summary import (
    MAX_GRAD_STEPS,
    NodeGrads,
    NodeSummary,
    RankStall,
)

ALERTS_SENT = 8  # the node's newest rank alerts in one summary


@dataclass
class NodeCache:
    """What a bridge keeps from one summary to the next: each rank's step figures, and the
    node's gradient rows with what they were read from (the ranks' rows and layouts)."""

    figures: FigureCache = field(default_factory=FigureCache)
    grads: tuple[Any, NodeGrads | None] | None = None


def layout_of(state: RunState) -> str:
    """A digest of a rank's watched layers (names and sizes): rows compare within one."""
    return _layout(tuple(state.layer_names), tuple(state.layer_numel))


@functools.lru_cache(maxsize=64)
def _layout(names: tuple[str, ...], numel: tuple[int, ...]) -> str:
    # Read for every rank on every summary; the names change once a run, if ever.
    text = "\n".join(f"{n}\t{k}" for n, k in zip(names, numel, strict=False))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def node_grads(
    states: Mapping[int, RunState], names_sent: str | None, cache: NodeCache | None = None
) -> NodeGrads | None:
    """The ranks' per-layer rows at their latest common sampled steps, each distinct row once
    (in the order first met, rank by rank); None when the ranks watch different layers here
    (the rule then does not apply) or share no sampled step. ``names_sent``: the layout whose
    names the viewer already has. With ``cache``, read again only when a rank's rows or layers
    changed since the last call."""
    if not states:
        return None
    layouts = {r: layout_of(s) for r, s in states.items()}
    key = (
        names_sent,
        tuple((r, s, s.grads, s.grads.total_rows, layouts[r]) for r, s in states.items()),
    )
    if cache is not None and cache.grads is not None and _same(cache.grads[0], key):
        return cache.grads[1]
    grads = _node_grads(states, set(layouts.values()), names_sent)
    if cache is not None:
        cache.grads = (key, grads)
    return grads


def _same(a: Any, b: Any) -> bool:
    """Whether two ``node_grads`` keys are equal: the states and histories by identity."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(
        x[0] == y[0] and x[1] is y[1] and x[2] is y[2] and x[3:] == y[3:]
        for x, y in zip(a[1], b[1], strict=True)
    )


def _node_grads(
    states: Mapping[int, RunState], layouts: set[str], names_sent: str | None
) -> NodeGrads | None:
    first = next(iter(states.values()))
    if len(layouts) != 1 or not first.layer_names:
        return None
    layout = layouts.pop()
    rows = {r: grad_rows(s) for r, s in states.items()}
    common = sorted(set.intersection(*(set(v) for v in rows.values())))[-MAX_GRAD_STEPS:]
    if not common:
        return None
    width = min(len(first.layer_names), *(len(rows[r][s]) for r in rows for s in common))
    names = None if names_sent == layout else tuple(first.layer_names[:width])
    # Every rank's rows at the common steps as one (rank x step, layer) array; rows equal to
    # the byte are one row of the table, numbered in the order first met.
    flat = np.array([rows[r][s][:width] for r in rows for s in common], dtype=float)
    if width:
        keys = np.ascontiguousarray(flat).view(np.dtype((np.void, 8 * width))).ravel()
        _, first_at, inverse = np.unique(keys, return_index=True, return_inverse=True)
    else:  # no layer: one empty row
        first_at, inverse = np.zeros(1, np.intp), np.zeros(len(flat), np.intp)
    order = np.argsort(first_at, kind="stable")
    number = np.empty(len(order), np.intp)
    number[order] = np.arange(len(order))
    numbered = number[inverse.ravel()].reshape(len(rows), len(common)).tolist()
    table = tuple(tuple(flat[i].tolist()) for i in first_at[order])
    which = {r: tuple(numbered[k]) for k, r in enumerate(rows)}
    return NodeGrads(layout, tuple(common), table, which, names)


def reduce_node(
    host: str,
    job: str,
    states: Mapping[int, RunState],
    names_sent: str | None = None,
    now: float | None = None,
    windows_sent: Mapping[int, int] | None = None,
    cache: NodeCache | None = None,
) -> NodeSummary:
    """The node's summary now: every rank's figures, the stalled ranks' collectives, the
    gradient rows and the newest rank alerts. ``windows_sent``: rank -> the end of the last
    window the viewer has of it (those after it are sent; all of a rank not in it). ``cache``
    (a bridge's, kept between calls): what did not change since is not read again."""
    sent = windows_sent or {}
    now = time.time() if now is None else now
    stalls = []
    alerts: list[tuple[int, str, str, int | None, str]] = []
    for rank, state in states.items():
        stall = still_stalled(state)
        if stall is not None:
            stalls.append(
                RankStall(rank, stall.seq, stall.op, stall.group, stall.where, stall.stack,
                          stall.sizes)
            )  # fmt: skip
        for alert in itertools.islice(state.alerts, 2):  # newest first
            alerts.append((rank, alert.kind, alert.severity, alert.step, alert.headline))
    alerts.sort(key=lambda a: -math.inf if a[3] is None else a[3], reverse=True)
    figures = None if cache is None else cache.figures
    if figures is not None:
        figures.keep(states)
    return NodeSummary(
        host=host,
        job=job,
        time=now,
        ranks=tuple(
            rank_figures(r, s, now, sent.get(r), figures) for r, s in sorted(states.items())
        ),
        stalls=tuple(stalls),
        # An ended rank's rows stop: kept, they would leave no step common to all.
        grads=node_grads({r: s for r, s in states.items() if not s.ended}, names_sent, cache),
        alerts=tuple(alerts[:ALERTS_SENT]),
        world=max(
            (w for s in states.values() if isinstance(w := s.run.get("world_size"), int)), default=0
        ),
    )


__all__ = [
    "RECENT",
    "NodeCache",
    "layout_of",
    "node_grads",
    "rank_figures",
    "rank_windows",
    "reduce_node",
]
