"""The node stream's ``summary`` (a node's ranks in a few figures each) and ``subscribe``."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import Any

from tdbg.protocol.messages.tolerant import as_dict, as_float, as_int, as_list, as_str

# ``tdbg bridge --job JOB --summaries`` reads its ranks itself and, SUMMARY_HZ times a second,
# sends one ``summary``: per rank a fixed handful of numbers (its step, the recent medians of
# its step time, own work and each phase, its latest loss and gradient norm, its state), the
# node's quantiles, its stalled ranks' last collectives, the node's median per-layer gradient
# rows and which ranks differ from them. Full probe streams then ride channels only for the
# ranks the viewer asks for with ``subscribe`` (and gives back with ``close``).
SUMMARY_VERSION = 1
MAX_SUMMARY_RANKS = 4096  # a node with more ranks than this is a malformed summary
MAX_GRAD_STEPS = 20  # sampled steps of gradient rows in one summary (the rule's window)
FIGURES = ("whole", "own", "loss", "grad")  # the per-rank floats besides the phases
# The per-rank memory figures (bytes, from the rank's latest ``system`` report): the CUDA
# allocator's allocated, reserved and peak (the most of the rank's devices), the process's RSS,
# and NVML's used memory of the rank's GPU; and that GPU's utilisation (percent).
MEMORY = ("allocated", "reserved", "peak", "rss", "gpu_mem")
QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
# Judged windows one summary carries a rank (the first summary's backlog; then the windows the
# rank finished since the last one, a few at most).
MAX_WINDOWS = 64


@dataclass(frozen=True, slots=True)
class RankWindow:
    """A rank's medians as at the end of one judged window (over the RECENT steps before
    ``end``): the record of which rank was the slowest over time is judged from these."""

    end: int  # the first step after the window
    whole: float | None
    own: float | None
    phases: dict[str, float | None]


@dataclass(frozen=True, slots=True)
class RankFigures:
    """One rank as a summary carries it. Times are medians of the recent steps (seconds);
    None where not measured yet."""

    rank: int
    step: int | None
    n_steps: int
    whole: float | None  # the step's time
    own: float | None  # the step less its backward (the straggler rule's own work)
    phases: dict[str, float | None]  # each phase's recent median (protocol.steps.PHASES)
    loss: float | None  # the latest
    grad: float | None  # the latest total gradient norm
    state: str = "live"  # live | stalled | the ended words (ending.ended_words)
    nonfinite: bool = False  # its loss went non-finite and stayed so
    windows: tuple[RankWindow, ...] = ()  # the windows it finished since the last summary
    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    rss: int | None = None
    gpu_mem: int | None = None
    gpu_util: float | None = None
    on_gpu: bool = False  # it trains on a GPU (else its GPU figures are "n/a")


@dataclass(frozen=True, slots=True)
class RankStall:
    """A rank's open ``stalled`` alert with the last collective it entered."""

    rank: int
    seq: int
    op: str
    group: str
    where: str = ""
    stack: str = ""
    sizes: Any = None


@dataclass(frozen=True, slots=True)
class NodeGrads:
    """The node's ranks' per-layer gradient norms at the latest sampled steps all of them have,
    each distinct row once: under data parallelism every rank's row is the same, so a healthy
    node sends one row a step, and a diverged rank one more."""

    layout: str  # a digest of the layer names and sizes: rows compare only within one layout
    steps: tuple[int, ...]
    rows: tuple[tuple[float, ...], ...]  # the distinct rows
    which: dict[int, tuple[int, ...]]  # rank -> its row (an index in ``rows``) at each step
    names: tuple[str, ...] | None = None  # sent with the first summary and when they change


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """``summary``: one node's ranks at ``time`` (the bridge's clock)."""

    host: str
    job: str
    time: float
    ranks: tuple[RankFigures, ...]
    stalls: tuple[RankStall, ...] = ()
    grads: NodeGrads | None = None
    alerts: tuple[tuple[int, str, str, int | None, str], ...] = ()  # rank, kind, severity...
    world: int = 0  # the job's world size as its ranks say it (0: not said)
    version: int = SUMMARY_VERSION

    def quantiles(self, figure: str) -> list[float] | None:
        """The node's min, quartiles and max of ``figure`` (a FIGURES name or a phase) over
        its ranks that measured it; None when none did."""
        values = [_figure(r, figure) for r in self.ranks]
        known = sorted(v for v in values if v is not None and math.isfinite(v))
        if not known:
            return None
        return [_quantile(known, q) for q in QUANTILES]

    def to_wire(self) -> dict[str, Any]:
        cols: dict[str, list[Any]] = {
            "rank": [r.rank for r in self.ranks],
            "step": [r.step for r in self.ranks],
            "n": [r.n_steps for r in self.ranks],
            "state": [r.state for r in self.ranks],
            "nonfinite": [r.nonfinite for r in self.ranks],
            "gpu_util": [r.gpu_util for r in self.ranks],
            "on_gpu": [r.on_gpu for r in self.ranks],
        }
        for name in MEMORY:
            cols[name] = [getattr(r, name) for r in self.ranks]
        for name in FIGURES:
            cols[name] = [_figure(r, name) for r in self.ranks]
        phases = sorted({p for r in self.ranks for p in r.phases})
        for phase in phases:
            cols[f"phase:{phase}"] = [r.phases.get(phase) for r in self.ranks]
        window_phases = sorted({p for r in self.ranks for w in r.windows for p in w.phases})
        if any(r.windows for r in self.ranks):
            # One flat row a window: [end, whole, own, each of window_phases].
            cols["windows"] = [
                [[w.end, w.whole, w.own, *(w.phases.get(p) for p in window_phases)]
                 for w in r.windows]
                for r in self.ranks
            ]  # fmt: skip
        out: dict[str, Any] = {
            "type": "summary",
            "v": self.version,
            "host": self.host,
            "job": self.job,
            "time": self.time,
            "world": self.world,
            "ranks": cols,
            "quantiles": {
                name: q for name in ("whole", "loss", "grad") if (q := self.quantiles(name))
            },
            "stalls": [
                {
                    "rank": s.rank,
                    "seq": s.seq,
                    "op": s.op,
                    "group": s.group,
                    "where": s.where,
                    "stack": s.stack,
                    "sizes": s.sizes,
                }
                for s in self.stalls
            ],  # fmt: skip
            "alerts": [list(a) for a in self.alerts],
        }
        if "windows" in cols:
            out["window_phases"] = window_phases
        if self.grads is not None:
            g = self.grads
            out["grads"] = {
                "layout": g.layout,
                "steps": list(g.steps),
                "rows": b"".join(struct.pack(f"<{len(row)}d", *row) for row in g.rows),
                "which": [[rank, list(rows)] for rank, rows in g.which.items()],
            }
            if g.names is not None:
                out["grads"]["names"] = list(g.names)
        return out

    @classmethod
    def from_wire(cls, value: Any) -> NodeSummary | None:
        """None when it is not a summary this reader knows (another version, no ranks)."""
        data = as_dict(value)
        if data.get("type") != "summary" or as_int(data.get("v")) != SUMMARY_VERSION:
            return None
        cols = as_dict(data.get("ranks"))
        ranks = as_list(cols.get("rank"))
        if not ranks or len(ranks) > MAX_SUMMARY_RANKS:
            return None
        n = len(ranks)

        def column(name: str) -> list[Any]:
            got = as_list(cols.get(name))
            return got if len(got) == n else [None] * n

        floats = {name: _floats(column(name)) for name in FIGURES}
        phases = {
            key.partition(":")[2]: _floats(column(key))
            for key in cols
            if isinstance(key, str) and key.startswith("phase:")
        }
        steps, counts = column("step"), column("n")
        states, flags = column("state"), column("nonfinite")
        memory = {name: column(name) for name in MEMORY}
        gpu_util, on_gpu = _floats(column("gpu_util")), column("on_gpu")
        window_phases = [as_str(p) or "?" for p in as_list(data.get("window_phases"))]
        windows = column("windows")
        figures = []
        for i, raw in enumerate(ranks):
            rank = as_int(raw)
            if rank is None:
                continue
            figures.append(
                RankFigures(
                    rank=rank,
                    step=as_int(steps[i]),
                    n_steps=as_int(counts[i]) or 0,
                    whole=floats["whole"][i],
                    own=floats["own"][i],
                    phases={p: v[i] for p, v in phases.items()},
                    loss=floats["loss"][i],
                    grad=floats["grad"][i],
                    state=as_str(states[i]) or "live",
                    nonfinite=flags[i] is True,
                    windows=_windows(windows[i], window_phases),
                    allocated=_bytes(memory["allocated"][i]),
                    reserved=_bytes(memory["reserved"][i]),
                    peak=_bytes(memory["peak"][i]),
                    rss=_bytes(memory["rss"][i]),
                    gpu_mem=_bytes(memory["gpu_mem"][i]),
                    gpu_util=gpu_util[i],
                    on_gpu=on_gpu[i] is True,
                )
            )
        return cls(
            host=as_str(data.get("host")) or "?",
            job=as_str(data.get("job")) or "",
            time=as_float(data.get("time")) or 0.0,
            ranks=tuple(figures),
            stalls=tuple(s for s in map(_stall, as_list(data.get("stalls"))) if s is not None),
            grads=_grads(data.get("grads")),
            alerts=tuple(a for a in map(_alert, as_list(data.get("alerts"))) if a is not None),
            world=max(0, as_int(data.get("world")) or 0),
        )


def with_windows_of(older: NodeSummary, newer: NodeSummary) -> NodeSummary:
    """``newer`` carrying the windows of ``older`` it replaces before they were read: a summary
    says everything an older one said but the windows, which each summary sends once (past
    MAX_WINDOWS a rank's oldest are dropped)."""
    before = {r.rank: r.windows for r in older.ranks if r.windows}
    if not before:
        return newer
    ranks = []
    for figures in newer.ranks:
        old = before.get(figures.rank, ())
        if figures.windows and old:
            old = tuple(w for w in old if w.end < figures.windows[0].end)
        if old:
            figures = replace(figures, windows=(*old, *figures.windows)[-MAX_WINDOWS:])
        ranks.append(figures)
    return replace(newer, ranks=tuple(ranks))


def subscribe(rank: int) -> dict[str, Any]:
    """client -> bridge: open a channel with rank ``rank``'s full probe stream."""
    return {"type": "subscribe", "rank": rank}


def _floats(values: list[Any]) -> list[float | None]:
    """``as_float`` of each value; a plain float taken as it is (the usual case, and a viewer
    of 1,024 ranks reads ~30,000 of them a second)."""
    return [v if type(v) is float else as_float(v) for v in values]


def _ints(values: Any) -> tuple[int, ...] | None:
    """A list of plain ints as a tuple; None when it is not one."""
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        return None
    return tuple(values)


def read_subscribe(value: Any) -> int | None:
    """The rank a ``subscribe`` asks for; None when ``value`` is not a well-formed one."""
    data = as_dict(value)
    return as_int(data.get("rank")) if data.get("type") == "subscribe" else None


def _figure(r: RankFigures, name: str) -> float | None:
    if name in FIGURES:
        value: float | None = getattr(r, name)
        return value
    return r.phases.get(name)


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linearly interpolated (numpy's default)."""
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def _stall(value: Any) -> RankStall | None:
    data = as_dict(value)
    rank, seq = as_int(data.get("rank")), as_int(data.get("seq"))
    if rank is None or seq is None:
        return None
    return RankStall(
        rank=rank,
        seq=seq,
        op=as_str(data.get("op")) or "collective",
        group=as_str(data.get("group")) or "default",
        where=as_str(data.get("where")) or "",
        stack=as_str(data.get("stack")) or "",
        sizes=data.get("sizes"),
    )


def _grads(value: Any) -> NodeGrads | None:
    data = as_dict(value)
    steps = _ints(data.get("steps"))
    raw = data.get("rows")
    if not steps or len(steps) > MAX_GRAD_STEPS or not isinstance(raw, bytes):
        return None
    items = as_list(data.get("which"))
    names = data.get("names")
    name_list = [as_str(x) or "?" for x in as_list(names)] if names is not None else None
    width = len(name_list) if name_list is not None else as_int(data.get("width"))
    count = len(raw) // 8
    if not raw or len(raw) % 8 or not items:
        return None
    # Every rank's rows at every step: the row count follows from the indices' range.
    which: dict[int, tuple[int, ...]] = {}
    for item in items:
        parts = as_list(item)
        rank = as_int(parts[0]) if len(parts) == 2 else None
        rows = _ints(parts[1]) if rank is not None else None
        if rank is None or rows is None or len(rows) != len(steps):
            return None
        which[rank] = rows
    n_rows = max(max(rows) for rows in which.values()) + 1
    if min(min(rows) for rows in which.values()) < 0 or count % n_rows:
        return None
    width = count // n_rows if width is None else width
    if width * n_rows != count:
        return None
    flat = struct.unpack(f"<{count}d", raw)
    return NodeGrads(
        layout=as_str(data.get("layout")) or "",
        steps=steps,
        rows=tuple(flat[i * width : (i + 1) * width] for i in range(n_rows)),
        which=which,
        names=None if name_list is None else tuple(name_list),
    )


def _bytes(value: Any) -> int | None:
    """A byte count; None when it is not a non-negative int."""
    n = as_int(value)
    return n if n is not None and n >= 0 else None


def _windows(value: Any, phases: list[str]) -> tuple[RankWindow, ...]:
    """A rank's windows from their flat rows; a malformed row is left out, and past
    MAX_WINDOWS the rest."""
    out = []
    for row in as_list(value)[:MAX_WINDOWS]:
        parts = as_list(row)
        end = as_int(parts[0]) if len(parts) == 3 + len(phases) else None
        if end is None:
            continue
        values = _floats(parts[1:])
        out.append(
            RankWindow(end, values[0], values[1], dict(zip(phases, values[2:], strict=True)))
        )
    return tuple(out)


def _alert(value: Any) -> tuple[int, str, str, int | None, str] | None:
    parts = as_list(value)
    if len(parts) != 5 or as_int(parts[0]) is None:
        return None
    rank = as_int(parts[0])
    assert rank is not None
    return (
        rank,
        as_str(parts[1]) or "?",
        as_str(parts[2]) or "info",
        as_int(parts[3]),
        as_str(parts[4]) or "",
    )
