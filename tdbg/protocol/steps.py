"""The columnar step batch, the one owner of its byte layout: pack, unpack, concat, last step."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from tdbg.protocol.framing import ErrorCode, ProtocolError

# Learning rates sent per step: a run with more param groups (one per layer, layer-wise decay)
# shows the first MAX_LR_COLUMNS of them, and the probe says so once.
MAX_LR_COLUMNS = 64
# A GPU run with short steps times the phases (CUDA events) of one step in a few, at random
# distances shorter than this (StepSampler._plan_marks); the others' phase columns are NaN.
# Readers that average phases look back this many times their window for the steps that have
# them.
MAX_PHASE_GAP = 32

# The phases a step's time splits into, in the order a step runs them (StepRecord's columns),
# and what a person reads for each: the anatomy bar's labels (long and short), and the words
# of a straggler finding. The one owner: the TUI, the job model and ``tdbg dump`` import these.
PHASES = ("data_time", "no_grad_time", "forward_time", "backward_time", "optimizer_time")
PHASE_LABELS = {
    "data_time": "data",
    "no_grad_time": "no-grad",
    "forward_time": "forward",
    "backward_time": "backward",
    "optimizer_time": "optimizer",
}
PHASE_SHORT_LABELS = {
    "data_time": "data",
    "no_grad_time": "no-grad",
    "forward_time": "fwd",
    "backward_time": "bwd",
    "optimizer_time": "opt",
}
PHASE_WORDS = {
    "data_time": "input wait",
    "no_grad_time": "no-grad forwards (evaluation)",
    "forward_time": "forward",
    "backward_time": "backward",
    "optimizer_time": "optimizer",
}

FLAG_HAS_LOSS = 1
FLAG_HAS_GRADS = 2

NAN = float("nan")


@dataclass(slots=True)
class StepRecord:
    """One training step as the probe saw it. Timings in seconds; NaN means not measured."""

    step: int
    time: float
    loss: float | None = None
    lr: list[float] = field(default_factory=list)
    step_time: float = NAN
    samples: float = NAN
    tokens: float = NAN
    data_time: float = NAN
    no_grad_time: float = NAN
    forward_time: float = NAN
    backward_time: float = NAN
    optimizer_time: float = NAN
    probe_time: float = NAN
    micro_batches: float = NAN
    clip_max: float = NAN
    clip_norm: float = NAN
    epoch: float = NAN
    grad_total: float | None = None
    grad_norms: Sequence[float] | None = None  # one per layer, in ``layers`` order


# The per-step timing columns, all little-endian f64, in StepRecord's field names.
F64_COLUMNS = (
    "time",
    "step_time",
    "samples",
    "tokens",
    "data_time",
    "forward_time",
    "backward_time",
    "optimizer_time",
    "probe_time",
    *("micro_batches", "clip_max", "clip_norm", "epoch"),
    "no_grad_time",
)
# What a step was, besides its timings (f64 too; NaN: not known): ``micro_batches`` backward
# passes (forwards with grad, where no backward is seen) since the previous step, for gradient
# accumulation; ``clip_max`` the ``max_norm`` a ``clip_grad_norm_`` was given this step and
# ``clip_norm`` the total norm it measured (before clipping: the clip was active when it is the
# larger); ``epoch`` the epoch the step belongs to; ``no_grad_time`` the time from a watched
# model's first forward without grad (an evaluation, a rollout) to the end of its last, before
# the step's own forward (``data_time`` is the rest of that gap). Batches written before these
# columns existed (older recordings) lack them: readers take NaN.
OPTIONAL_COLUMNS = frozenset({"micro_batches", "clip_max", "clip_norm", "epoch", "no_grad_time"})


# Every column of a ``steps`` message, in wire order, with its ``array`` typecode (each column
# is a little-endian array of that type): the one place the layout is written down. Per row:
# ``step``, ``flags`` (FLAG_HAS_LOSS | FLAG_HAS_GRADS), ``loss``, ``lr_n`` and the timings;
# ``lr`` is n x lr_groups; ``grad_total`` one per row with grads, ``grad_norms`` that many rows
# x layers. A numpy reader takes each decoded column's dtype from its ``typecode``.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "q"),
    ("flags", "B"),
    ("loss", "d"),
    ("lr", "d"),
    ("lr_n", "B"),
    *((name, "d") for name in F64_COLUMNS),
    ("grad_total", "d"),
    ("grad_norms", "f"),
)
TYPECODE: dict[str, str] = dict(COLUMNS)
ITEMSIZE: dict[str, int] = {name: array(code).itemsize for name, code in COLUMNS}


def _packed(column: str, values: Iterable[float]) -> bytes:
    arr = array(TYPECODE[column], values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _unpacked(column: str, data: bytes) -> array:
    arr = array(TYPECODE[column])
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def _column(msg: dict[str, Any], name: str, n: int) -> bytes:
    """A column's bytes; an optional column a batch lacks (an older writer) reads as NaN."""
    if name in OPTIONAL_COLUMNS and name not in msg:
        return _packed(name, [NAN] * n)
    return bytes(msg[name])


def pack_steps(records: Sequence[StepRecord], n_layers: int, history: bool = False) -> dict:
    """Pack step records into one columnar ``steps`` message: the :data:`COLUMNS`, ``lr``
    NaN-padded to the widest row, ``lr_n`` saying how many of a row's lr columns are real."""
    groups = max((len(r.lr) for r in records), default=0)
    if groups > MAX_LR_COLUMNS:
        raise ValueError(f"{groups} learning rates in a step: at most {MAX_LR_COLUMNS} are sent")
    msg: dict[str, Any] = {
        "type": "steps",
        "n": len(records),
        "layers": n_layers,
        "lr_groups": groups,
        "history": history,
        "step": _packed("step", map(attrgetter("step"), records)),
        "flags": _packed(
            "flags",
            (
                (FLAG_HAS_LOSS if r.loss is not None else 0)
                | (FLAG_HAS_GRADS if r.grad_norms is not None else 0)
                for r in records
            ),
        ),
        "loss": _packed("loss", (NAN if r.loss is None else r.loss for r in records)),
        "lr": _packed("lr", (v for r in records for v in (*r.lr, *[NAN] * (groups - len(r.lr))))),
        # How many of a row's lr columns are real: a NaN lr (unreadable) is not padding.
        "lr_n": _packed("lr_n", (len(r.lr) for r in records)),
    }
    for name in F64_COLUMNS:
        # map(attrgetter) runs in C: per step and column this is the probe thread's GIL time.
        msg[name] = _packed(name, map(attrgetter(name), records))
    with_grads = [r for r in records if r.grad_norms is not None]
    msg["grad_total"] = _packed(
        "grad_total", (NAN if r.grad_total is None else r.grad_total for r in with_grads)
    )
    norms: array[float] = array(TYPECODE["grad_norms"])
    for r in with_grads:
        row = r.grad_norms
        assert row is not None
        if len(row) > n_layers:
            raise ValueError(f"step {r.step}: {len(row)} grad norms for {n_layers} layers")
        norms.extend(row)
        # A row from before layers were added (the run's layers only grow): NaN for the new.
        norms.extend([NAN] * (n_layers - len(row)))
    if sys.byteorder != "little":
        norms.byteswap()
    msg["grad_norms"] = norms.tobytes()
    return msg


@dataclass(frozen=True, slots=True)
class StepColumns:
    """A ``steps`` batch's columns, checked for consistent sizes, as native-order arrays of
    their :data:`COLUMNS` typecodes: a numpy reader wraps each with
    ``np.frombuffer(column, column.typecode)``, nothing here needs numpy."""

    n: int
    n_layers: int
    lr_groups: int
    step: array  # n
    flags: array  # n
    loss: array  # n (NaN where flags say no loss)
    lr: array  # n x lr_groups, NaN-padded past each row's lr_n
    lr_n: array  # n: a row's real learning rates; the rest of its lr columns are padding
    timings: dict[str, array]  # F64_COLUMNS, n each
    grad_total: array  # one per row with grads
    grad_norms: array  # rows with grads x n_layers

    @property
    def has_grads(self) -> list[bool]:
        return [bool(f & FLAG_HAS_GRADS) for f in self.flags]


def step_columns(msg: dict[str, Any]) -> StepColumns:
    """Decode a ``steps`` message's columns; ProtocolError when they are malformed."""
    try:
        n, n_layers, groups = int(msg["n"]), int(msg["layers"]), int(msg["lr_groups"])
        columns = StepColumns(
            n=n,
            n_layers=n_layers,
            lr_groups=groups,
            step=_unpacked("step", msg["step"]),
            flags=_unpacked("flags", msg["flags"]),
            loss=_unpacked("loss", msg["loss"]),
            lr=_unpacked("lr", msg["lr"]),
            lr_n=_unpacked("lr_n", msg["lr_n"]),
            timings={name: _unpacked(name, _column(msg, name, n)) for name in F64_COLUMNS},
            grad_total=_unpacked("grad_total", msg["grad_total"]),
            grad_norms=_unpacked("grad_norms", msg["grad_norms"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed steps message: {exc}", ErrorCode.BAD_MESSAGE) from None
    rows_with_grads = sum(1 for f in columns.flags if f & FLAG_HAS_GRADS)
    sizes_ok = (
        n >= 0
        and n_layers >= 0
        and groups >= 0
        and len(columns.step) == n
        and len(columns.flags) == n
        and len(columns.loss) == n
        and len(columns.lr) == n * groups
        and len(columns.lr_n) == n
        and all(k <= groups for k in columns.lr_n)
        and all(len(c) == n for c in columns.timings.values())
        and len(columns.grad_total) == rows_with_grads
        and len(columns.grad_norms) == rows_with_grads * n_layers
    )
    if not sizes_ok:
        raise ProtocolError("malformed steps message: column sizes disagree", ErrorCode.BAD_MESSAGE)
    return columns


def unpack_steps(msg: dict[str, Any]) -> list[StepRecord]:
    """The inverse of :func:`pack_steps`; raises ProtocolError on inconsistent columns."""
    c = step_columns(msg)
    out: list[StepRecord] = []
    g = 0
    groups, n_layers = c.lr_groups, c.n_layers
    for i in range(c.n):
        rec = StepRecord(
            step=c.step[i],
            time=c.timings["time"][i],
            loss=c.loss[i] if c.flags[i] & FLAG_HAS_LOSS else None,
            lr=c.lr[i * groups : i * groups + c.lr_n[i]].tolist(),
            **{name: c.timings[name][i] for name in F64_COLUMNS if name != "time"},
        )
        if c.flags[i] & FLAG_HAS_GRADS:
            total = c.grad_total[g]
            rec.grad_total = None if math.isnan(total) and n_layers == 0 else total
            rec.grad_norms = c.grad_norms[g * n_layers : (g + 1) * n_layers].tolist()
            g += 1
        out.append(rec)
    return out


def last_step(msg: dict[str, Any]) -> int | None:
    """The last step number in a ``steps`` message, reading one value (no numpy, no object per
    step); None when it has no step (empty, or not a well-formed step column)."""
    size = ITEMSIZE["step"]
    try:
        column = bytes(msg["step"])
        if int(msg["n"]) <= 0 or len(column) < size:
            return None
    except (KeyError, TypeError, ValueError):
        return None
    return int(_unpacked("step", column[-size:])[0])


def batch_bytes(msg: dict[str, Any]) -> int:
    """Bytes a ``steps`` message's columns take: its size, near enough, for a byte budget."""
    return sum(len(v) for name, _ in COLUMNS if isinstance(v := msg.get(name), bytes))


def row_bytes(n_layers: int, lr_groups: int = 1) -> int:
    """Bytes one step with per-layer norms adds to a batch (``lr_groups`` learning rates)."""
    per_row = sum(ITEMSIZE[name] for name in ("step", "flags", "loss", "lr_n", *F64_COLUMNS))
    return per_row + lr_groups * ITEMSIZE["lr"] + grad_row_bytes({"layers": n_layers})


def joinable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``steps`` messages can be joined byte-wise by :func:`concat_steps`: the same
    layer and param-group counts, so their rows have the same width."""
    return bool(a["layers"] == b["layers"] and a["lr_groups"] == b["lr_groups"])


def grad_rows(msg: dict[str, Any]) -> int:
    """Rows with per-layer norms in a ``steps`` message (each has one total)."""
    return len(msg["grad_total"]) // ITEMSIZE["grad_total"]


def grad_row_bytes(msg: dict[str, Any]) -> int:
    """Bytes one row with per-layer norms takes: its total and one norm per layer."""
    return ITEMSIZE["grad_total"] + ITEMSIZE["grad_norms"] * int(msg["layers"])


def drop_grad_rows(msg: dict[str, Any], keep: Sequence[int]) -> dict[str, Any]:
    """``msg`` without the per-layer rows whose ``keep`` entry is 0 (one entry per row with
    grads); the scalars are untouched. Byte slicing: no object per step."""
    flags = bytes(msg["flags"])
    width = ITEMSIZE["grad_norms"] * int(msg["layers"])
    t = ITEMSIZE["grad_total"]
    totals, norms = bytes(msg["grad_total"]), bytes(msg["grad_norms"])
    out = dict(msg)
    out["grad_total"] = b"".join(totals[t * g : t * (g + 1)] for g, k in enumerate(keep) if k)
    out["grad_norms"] = b"".join(
        norms[width * g : width * (g + 1)] for g, k in enumerate(keep) if k
    )
    new_flags = bytearray(flags)
    g = 0
    for i, f in enumerate(flags):
        if f & FLAG_HAS_GRADS:
            if not keep[g]:
                new_flags[i] = f & ~FLAG_HAS_GRADS
            g += 1
    out["flags"] = bytes(new_flags)
    return out


def concat_steps(messages: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Join ``steps`` messages into one by concatenating their columns: no Python object per
    step (the probe thread merges history this way without feeding the garbage collector).
    None when they cannot be joined byte-wise (different layer or param-group counts)."""
    if not messages:
        return None
    first = messages[0]
    if not all(joinable(first, m) for m in messages):
        return None
    out: dict[str, Any] = {k: first[k] for k in ("type", "layers", "lr_groups", "history")}
    out["n"] = sum(int(m["n"]) for m in messages)
    for column, _ in COLUMNS:
        out[column] = b"".join(_column(m, column, int(m["n"])) for m in messages)
    return out


def thin_rows(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` with every other step kept — the last one always — and no per-layer rows: a
    history too large for its budget keeps the shape of an old stretch at half the resolution.
    Column-wise C-level slicing (``array[start::2]``): no object per step."""
    n = int(msg["n"])
    groups = int(msg["lr_groups"])
    out: dict[str, Any] = {
        k: msg[k] for k in ("type", "layers", "lr_groups", "history") if k in msg
    }
    start = (n - 1) % 2  # so that the batch's last step stays
    kept = (n - start + 1) // 2
    out["n"] = kept
    for column, _ in COLUMNS:
        if column in ("grad_total", "grad_norms"):
            out[column] = b""
            continue
        arr = _unpacked(column, _column(msg, column, n))
        if column == "lr" and groups > 1:
            thinned = array(arr.typecode, bytes(kept * groups * arr.itemsize))
            for j in range(groups):  # one extended slice per param group, not per step
                thinned[j::groups] = arr[j::groups][start::2]
        else:
            thinned = arr[start::2]
        if column == "flags":
            thinned = array("B", bytes(f & ~FLAG_HAS_GRADS for f in thinned))
        if sys.byteorder != "little":
            thinned.byteswap()
        out[column] = thinned.tobytes()
    return out
