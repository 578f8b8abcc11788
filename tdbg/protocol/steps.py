"""The columnar step batch, the one owner of its byte layout: pack, unpack, concat, last step."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tdbg.protocol.framing import ErrorCode, ProtocolError

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
    forward_time: float = NAN
    backward_time: float = NAN
    optimizer_time: float = NAN
    probe_time: float = NAN
    grad_total: float | None = None
    grad_norms: Sequence[float] | None = None  # one per layer, in ``layers`` order


_F64_COLUMNS = (
    "time",
    "step_time",
    "samples",
    "tokens",
    "data_time",
    "forward_time",
    "backward_time",
    "optimizer_time",
    "probe_time",
)


def _packed(typecode: str, values: Iterable[float]) -> bytes:
    arr = array(typecode, values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _unpacked(typecode: str, data: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def pack_steps(records: Sequence[StepRecord], n_layers: int, history: bool = False) -> dict:
    """Pack step records into one columnar ``steps`` message (little-endian binary arrays).

    Columns: ``step`` (i64), ``flags`` (u8: 1 has loss, 2 has per-layer grads), ``loss`` and the
    f64 columns of StepRecord, ``lr`` (n x lr_groups f64, NaN-padded), ``lr_n`` (u8: groups in
    each row), ``grad_total`` (f64 per row with grads), ``grad_norms`` (rows with grads x n_layers
    f32).
    """
    groups = max((len(r.lr) for r in records), default=0)
    if groups > 255:
        raise ValueError(f"{groups} param groups: at most 255 are supported")
    msg: dict[str, Any] = {
        "type": "steps",
        "n": len(records),
        "layers": n_layers,
        "lr_groups": groups,
        "history": history,
        "step": _packed("q", (r.step for r in records)),
        "flags": bytes(
            (FLAG_HAS_LOSS if r.loss is not None else 0)
            | (FLAG_HAS_GRADS if r.grad_norms is not None else 0)
            for r in records
        ),
        "loss": _packed("d", (NAN if r.loss is None else r.loss for r in records)),
        "lr": _packed("d", (v for r in records for v in (*r.lr, *[NAN] * (groups - len(r.lr))))),
        # How many of a row's lr columns are real: a NaN lr (unreadable) is not padding.
        "lr_n": bytes(len(r.lr) for r in records),
    }
    for name in _F64_COLUMNS:
        msg[name] = _packed("d", (getattr(r, name) for r in records))
    with_grads = [r for r in records if r.grad_norms is not None]
    msg["grad_total"] = _packed(
        "d", (NAN if r.grad_total is None else r.grad_total for r in with_grads)
    )
    norms = array("f")
    for r in with_grads:
        row = r.grad_norms
        assert row is not None
        if len(row) != n_layers:
            raise ValueError(f"step {r.step}: {len(row)} grad norms for {n_layers} layers")
        norms.extend(row)
    if sys.byteorder != "little":
        norms.byteswap()
    msg["grad_norms"] = norms.tobytes()
    return msg


def unpack_steps(msg: dict[str, Any]) -> list[StepRecord]:
    """The inverse of :func:`pack_steps`; raises ProtocolError on inconsistent columns."""
    try:
        n, n_layers, groups = int(msg["n"]), int(msg["layers"]), int(msg["lr_groups"])
        steps = _unpacked("q", msg["step"])
        flags = bytes(msg["flags"])
        loss = _unpacked("d", msg["loss"])
        lr = _unpacked("d", msg["lr"])
        cols = {name: _unpacked("d", msg[name]) for name in _F64_COLUMNS}
        totals = _unpacked("d", msg["grad_total"])
        norms = _unpacked("f", msg["grad_norms"])
        lr_n = bytes(msg["lr_n"])
        rows_with_grads = sum(1 for f in flags if f & FLAG_HAS_GRADS)
        sizes_ok = (
            len(steps) == n
            and len(flags) == n
            and len(loss) == n
            and len(lr) == n * groups
            and len(lr_n) == n
            and all(k <= groups for k in lr_n)
            and all(len(c) == n for c in cols.values())
            and len(totals) == rows_with_grads
            and len(norms) == rows_with_grads * n_layers
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed steps message: {exc}", ErrorCode.BAD_MESSAGE) from None
    if not sizes_ok:
        raise ProtocolError("malformed steps message: column sizes disagree", ErrorCode.BAD_MESSAGE)
    out: list[StepRecord] = []
    g = 0
    for i in range(n):
        has_grads = bool(flags[i] & FLAG_HAS_GRADS)
        lrs = lr[i * groups : i * groups + lr_n[i]].tolist()
        rec = StepRecord(
            step=steps[i],
            time=cols["time"][i],
            loss=loss[i] if flags[i] & FLAG_HAS_LOSS else None,
            lr=lrs,
            **{name: cols[name][i] for name in _F64_COLUMNS if name != "time"},
        )
        if has_grads:
            total = totals[g]
            rec.grad_total = None if math.isnan(total) and n_layers == 0 else total
            rec.grad_norms = norms[g * n_layers : (g + 1) * n_layers].tolist()
            g += 1
        out.append(rec)
    return out


_CONCAT_COLUMNS = ("step", "flags", "loss", "lr", "lr_n", *_F64_COLUMNS, "grad_total", "grad_norms")


def concat_steps(messages: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Join ``steps`` messages into one by concatenating their columns: no Python object per
    step (the probe thread merges history this way without feeding the garbage collector).
    None when they cannot be joined byte-wise (different layer or param-group counts)."""
    if not messages:
        return None
    first = messages[0]
    if any(
        m["layers"] != first["layers"] or m["lr_groups"] != first["lr_groups"] for m in messages
    ):
        return None
    out: dict[str, Any] = {k: first[k] for k in ("type", "layers", "lr_groups", "history")}
    out["n"] = sum(int(m["n"]) for m in messages)
    for column in _CONCAT_COLUMNS:
        out[column] = b"".join(bytes(m[column]) for m in messages)
    return out
