"""One node's ranks reduced to a ``summary`` (what ``tdbg bridge --job --summaries`` sends)."""

from __future__ import annotations

import hashlib
import itertools
import math
import time
import warnings
from collections.abc import Iterable, Mapping

import numpy as np

from tdbg.model.ending import ended_words
from tdbg.model.health import assess
from tdbg.model.job import (
    MAX_PHASE_GAP,
    RECENT,
    busy_median,
    grad_rows,
    recent_median,
    still_stalled,
)
from tdbg.model.job_table import rank_gpu, rank_gpu_util
from tdbg.model.run_state import RunState
from tdbg.model.straggler_history import SPAN, WINDOW
from tdbg.protocol.messages.node_summary import (
    MAX_GRAD_STEPS,
    NodeGrads,
    NodeSummary,
    RankFigures,
    RankStall,
    RankWindow,
)
from tdbg.protocol.steps import PHASES

ALERTS_SENT = 8  # the node's newest rank alerts in one summary


def layout_of(state: RunState) -> str:
    """A digest of a rank's watched layers (names and sizes): rows compare within one."""
    pairs = zip(state.layer_names, state.layer_numel, strict=False)
    text = "\n".join(f"{n}\t{k}" for n, k in pairs)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def rank_windows(state: RunState, after: int | None = None) -> tuple[RankWindow, ...]:
    """A rank's medians at the end of each window it finished after the one ending at step
    ``after`` (None: the last SPAN), as the record of the slowest rank over time reads a
    rank's own steps (straggler_history._judge): the viewer judges the job from these."""
    if not state.n_steps or state.last_step is None:
        return ()
    steps = state.steps.values
    first = (int(steps[0]) // WINDOW + 1) * WINDOW  # as _first_common starts the record
    ready = (state.last_step + 1) // WINDOW * WINDOW
    if after is not None and after > ready:
        after = None  # the rank is back before what was sent: it restarted; sent afresh
    start = max(first, ready - (SPAN - 1) * WINDOW)
    if after is not None:
        start = max(start, after + WINDOW)
    ends = np.arange(start, ready + 1, WINDOW)
    if not ends.size:
        return ()
    rows = np.searchsorted(steps, ends)
    step = state.cols["step_time"].values
    backward = state.cols["backward_time"].values
    own = np.where(np.isfinite(backward), step - backward, np.nan)
    whole = window_medians(step, rows, RECENT)
    mine = window_medians(own, rows, RECENT * MAX_PHASE_GAP)
    phases = {
        p: window_medians(state.cols[p].values, rows, RECENT * MAX_PHASE_GAP)
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
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN row: NaN, as meant
        out = np.nanmedian(table, axis=1)
    out[counts < RECENT // 2] = np.nan
    return out


def _known(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def rank_figures(
    rank: int, state: RunState, now: float | None = None, windows_after: int | None = None
) -> RankFigures:
    """A rank's few figures: the same medians the straggler rule reads (job.py), and its
    windows finished after step ``windows_after`` (``rank_windows``)."""
    grad = state.grad_total.values[-RECENT:]
    grad = grad[np.isfinite(grad)]  # the latest measured (not every step measures it)
    status = "live"
    if state.ended:
        status = ended_words(state.end_reason)
    elif assess(state, now, by_arrival=True).word == "stalled":
        status = "stalled"
    loss = state.last_loss
    system = state.system
    cuda = system.cuda if system is not None else ()
    gpu = rank_gpu(state)
    return RankFigures(
        rank=rank,
        step=state.last_step,
        n_steps=state.n_steps,
        whole=busy_median(state, False),
        own=busy_median(state, True),
        phases={p: recent_median(state, p) for p in PHASES},
        loss=loss,
        grad=float(grad[-1]) if grad.size else None,
        state=status,
        nonfinite=state.diverged,
        windows=rank_windows(state, windows_after),
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


def node_grads(states: Mapping[int, RunState], names_sent: str | None) -> NodeGrads | None:
    """The ranks' per-layer rows at their latest common sampled steps, each distinct row once;
    None when the ranks watch different layers here (the rule then does not apply) or share
    no sampled step. ``names_sent``: the layout whose names the viewer already has."""
    if not states:
        return None
    layouts = {layout_of(s) for s in states.values()}
    first = next(iter(states.values()))
    if len(layouts) != 1 or not first.layer_names:
        return None
    layout = layouts.pop()
    rows = {r: grad_rows(s) for r, s in states.items()}
    common = sorted(set.intersection(*(set(v) for v in rows.values())))[-MAX_GRAD_STEPS:]
    if not common:
        return None
    width = min(len(first.layer_names), *(len(rows[r][s]) for r in rows for s in common))
    distinct: dict[bytes, int] = {}
    table: list[tuple[float, ...]] = []
    which: dict[int, tuple[int, ...]] = {}
    for rank, by_step in rows.items():
        mine = []
        for step in common:
            row = np.ascontiguousarray(by_step[step][:width], float)
            key = row.tobytes()
            if key not in distinct:
                distinct[key] = len(table)
                table.append(tuple(float(x) for x in row))
            mine.append(distinct[key])
        which[rank] = tuple(mine)
    names = None if names_sent == layout else tuple(first.layer_names[:width])
    return NodeGrads(layout, tuple(common), tuple(table), which, names)


def reduce_node(
    host: str,
    job: str,
    states: Mapping[int, RunState],
    names_sent: str | None = None,
    now: float | None = None,
    windows_sent: Mapping[int, int] | None = None,
) -> NodeSummary:
    """The node's summary now: every rank's figures, the stalled ranks' collectives, the
    gradient rows and the newest rank alerts. ``windows_sent``: rank -> the end of the last
    window the viewer has of it (those after it are sent; all of a rank not in it)."""
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
    return NodeSummary(
        host=host,
        job=job,
        time=now,
        ranks=tuple(rank_figures(r, s, now, sent.get(r)) for r, s in sorted(states.items())),
        stalls=tuple(stalls),
        # An ended rank's rows stop: kept, they would leave no step common to all.
        grads=node_grads({r: s for r, s in states.items() if not s.ended}, names_sent),
        alerts=tuple(alerts[:ALERTS_SENT]),
        world=max(
            (w for s in states.values() if isinstance(w := s.run.get("world_size"), int)), default=0
        ),
    )


__all__ = ["RECENT", "layout_of", "node_grads", "rank_figures", "rank_windows", "reduce_node"]
