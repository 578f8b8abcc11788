"""The tdbg wire, sans-IO: preamble, length-prefixed msgpack frames, message schemas, step batches.

Every connection starts with an 8-byte preamble from each side (``b"TDBG"`` + u16 min_version +
u16 max_version, big-endian), then frames: a u32 big-endian length followed by a msgpack payload.
Length 0 is invalid. A peer that announces an oversized length is rejected before a byte of the
payload is read or allocated. No pickle, no msgpack ext types, ever.

The same :class:`Decoder` serves sockets, recordings and tests: ``decoder.feed(chunk)`` returns the
messages completed by ``chunk`` whether it is 1 byte or 1 MB.

Message types (every message is a map with a ``type`` key)
-----------------------------------------------------------

Client -> probe (schema-checked by :func:`validate_client_message`; a map of ``type``, ``id`` and
``args`` and nothing else; inbound frames are at most 64 KiB):

``hello``   args ``{proto_min: int, proto_max: int, client_version: str}``; the first frame.
``ping``    args ``{}`` — the probe answers ``pong`` with the same id.
``bye``     args ``{}`` — the client is leaving.

Commands (deep dives; see :data:`COMMANDS` for every field's type, bounds and default — a field
not listed there is refused, never ignored; no field can name a path, module or expression):

``profile``      ``{steps 1-200 =5, max_seconds 1-120 =30, record_shapes, profile_memory,
                 with_stack}`` — torch.profiler over the next ``steps`` steps.
``snapshot``     ``{steps 1-50 =3, max_entries 1000-100000 =100000}`` — CUDA allocator history
                 over the next ``steps`` steps, dumped for PyTorch's memory visualizer.
``nan_hunt``     ``{steps 1-100 =1}`` — hooks on every module for up to ``steps`` steps; names
                 the first module whose output or gradient is non-finite.
``anomaly``      ``{steps 1-50 =10, check_nan =false}`` — autograd anomaly mode for ``steps``
                 steps; ``check_nan`` only where ``watch(anomaly_check_nan=True)`` allowed it.
``activations``  ``{every 1-10000 =10, enabled =true}`` — per-module output statistics every
                 ``every`` steps, or off.
``cancel``       ``{job}`` — stop a job early (a profile still analyses the steps it recorded).

A command is answered with ``ack`` (accepted) or ``error`` (refused: BUSY, UNAVAILABLE, READ_ONLY,
BAD_MESSAGE, RATE_LIMITED, ...); its progress then arrives as ``job`` messages, sent to every
client.

Probe -> client (outbound frames are at most 4 MiB):

``welcome`` ``{proto, server_version, run: RunInfo}`` — the answer to hello. RunInfo is
            ``{name, pid, rank, host, argv, start_time, socket, proto_min, proto_max}``.
``layers``  ``{names: [str], numel: [int]}`` — the layers whose gradients are watched, in the
            order used by every ``grad_norms`` array. Sent before any step.
``steps``   a batch of step records packed columnar (see :func:`pack_steps`); ``history: true``
            marks batches replayed to a late client. Per-layer norms may be present for only
            some steps (sampled steps, or downsampled history).
``alert``   ``{kind, severity, step, time, message, layers: [str]}``; ``history: true`` if replayed.
``system``  ``{time, host: {...}, cuda: [{...}], gpus: [{...}], missing: [str]}`` — memory and
            device figures; a figure that cannot be measured is absent or ``None`` and ``missing``
            says why (no CUDA, no NVML, ...).
``probe``   ``{time, cost_fraction, grad_interval, overhead_budget, errors, last_error, dropped,
            clients, steps_seen}`` — the probe's own health and cost.
``synced``  ``{}`` — history replay is complete; everything after it is live.
``pong``    ``{id}``.
``error``   ``{code, id, message}`` — a refusal or protocol error (codes: :class:`ErrorCode`).
``bye``     ``{reason}`` — the probe closes this connection (``shutdown``, ``slow_consumer``).
``ack``     ``{id, command, job, message}`` — a command was accepted as job number ``job``;
            ``message`` carries warnings (anomaly mode is global and slow).
``job``     ``{job, command, state, step, done, total, message, args, time, result}`` — a job's
            progress: ``state`` is one of :data:`JOB_STATES`; ``done``/``total`` count steps;
            ``result`` (on ``done``) is the command's answer (see docs/dump.md). Finished jobs
            are replayed to late clients with ``history: true``.
``activations`` ``{step, names, types, mean, std, min, max, zero_frac, nonfinite}`` — per-module
            output statistics of one sampled step; the value lists are in ``names`` order.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
PROTO_MIN = 1
PROTO_MAX = 1

MAGIC = b"TDBG"
PREAMBLE = struct.Struct(">4sHH")
PREAMBLE_SIZE = PREAMBLE.size  # 8 bytes
FRAME_HEADER = struct.Struct(">I")

MAX_INBOUND_FRAME = 64 * 1024  # client -> probe
MAX_OUTBOUND_FRAME = 4 * 1024 * 1024  # probe -> client

# Schema bounds for client messages (RELIABILITY.md R21).
MAX_DEPTH = 8
MAX_STRING = 4096
MAX_ARRAY = 1024

CLIENT_TYPES: dict[str, frozenset[str]] = {
    "hello": frozenset({"proto_min", "proto_max", "client_version"}),
    "ping": frozenset(),
    "bye": frozenset(),
}


@dataclass(frozen=True, slots=True)
class Field:
    """One command argument: its type (``int``, ``float`` or ``bool``), bounds and default."""

    kind: type
    default: int | float | bool | None
    lo: float = 0
    hi: float = 0

    def check(self, command: str, name: str, value: Any) -> int | float | bool:
        where = f"{command}.{name}"
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ProtocolError(f"{where} must be true or false", ErrorCode.BAD_MESSAGE)
            return value
        number_ok = isinstance(value, int | float) and not isinstance(value, bool)
        if self.kind is int and not isinstance(value, int):
            number_ok = False
        if not number_ok or not self.lo <= value <= self.hi:
            kind = "an integer" if self.kind is int else "a number"
            raise ProtocolError(
                f"{where} must be {kind} {self.lo:g}-{self.hi:g}", ErrorCode.BAD_MESSAGE
            )
        return self.kind(value)


# The static allowlist of commands (R28) with every argument typed and bounded (R29, R33).
COMMANDS: dict[str, dict[str, Field]] = {
    "profile": {
        "steps": Field(int, 5, 1, 200),
        "max_seconds": Field(float, 30.0, 1, 120),
        "record_shapes": Field(bool, False),
        "profile_memory": Field(bool, False),
        "with_stack": Field(bool, False),
    },
    "snapshot": {
        "steps": Field(int, 3, 1, 50),
        "max_entries": Field(int, 100_000, 1000, 100_000),
    },
    "nan_hunt": {"steps": Field(int, 1, 1, 100)},
    "anomaly": {"steps": Field(int, 10, 1, 50), "check_nan": Field(bool, False)},
    "activations": {"every": Field(int, 10, 1, 10_000), "enabled": Field(bool, True)},
    "cancel": {"job": Field(int, None, 1, 2**31 - 1)},
}

CLIENT_TYPES.update({name: frozenset(schema) for name, schema in COMMANDS.items()})
MUTATING = frozenset(COMMANDS) - {"cancel"}  # change the training process's state (R34, R35)

JOB_STATES = ("armed", "running", "analysing", "done", "failed", "cancelled")
FINAL_STATES = frozenset({"done", "failed", "cancelled"})


def command_args(command: str, args: dict[str, Any]) -> dict[str, Any]:
    """The command's arguments checked against its schema, with defaults filled in."""
    schema = COMMANDS[command]
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        if name in args:
            out[name] = spec.check(command, name, args[name])
        elif spec.default is None:
            raise ProtocolError(f"{command}.{name} is required", ErrorCode.BAD_MESSAGE)
        else:
            out[name] = spec.default
    return out


class ErrorCode:
    """Error codes carried by ``error`` messages."""

    BAD_FRAME = "BAD_FRAME"
    BAD_MESSAGE = "BAD_MESSAGE"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    BUSY = "BUSY"
    RATE_LIMITED = "RATE_LIMITED"
    INTERNAL = "INTERNAL"
    TIMEOUT = "TIMEOUT"
    UNAVAILABLE = "UNAVAILABLE"
    READ_ONLY = "READ_ONLY"


class ProtocolError(Exception):
    """The peer sent something that is not tdbg protocol; the connection should be closed."""

    def __init__(self, message: str, code: str = ErrorCode.BAD_FRAME) -> None:
        super().__init__(message)
        self.code = code


def preamble(proto_min: int = PROTO_MIN, proto_max: int = PROTO_MAX) -> bytes:
    """The 8 bytes each side sends first."""
    return PREAMBLE.pack(MAGIC, proto_min, proto_max)


def pack(message: dict[str, Any], max_frame: int = MAX_OUTBOUND_FRAME) -> bytes:
    """Encode one message as a complete frame (header + payload)."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_frame:
        raise ProtocolError(
            f"message of {len(payload)} bytes exceeds the {max_frame}-byte frame cap"
        )
    return FRAME_HEADER.pack(len(payload)) + payload


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed", ErrorCode.BAD_MESSAGE)


def unpack_payload(payload: bytes) -> Any:
    """Decode one frame's payload; msgpack bounds every length by the payload size itself."""
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            use_list=True,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"undecodable payload: {exc}", ErrorCode.BAD_MESSAGE) from None


class Decoder:
    """Turns a byte stream into a preamble and messages; raises ProtocolError on bad input.

    ``max_frame`` is the cap for frames *received*: 64 KiB on the probe side, 4 MiB on a client.
    """

    def __init__(self, max_frame: int, expect_preamble: bool = True) -> None:
        self.max_frame = max_frame
        self.peer_versions: tuple[int, int] | None = None
        self._need_preamble = expect_preamble
        self._buf = bytearray()
        self._frame_len: int | None = None

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame (or preamble) has arrived but not all of it."""
        return bool(self._buf) or self._frame_len is not None

    def feed(self, chunk: bytes) -> list[Any]:
        self._buf += chunk
        out: list[Any] = []
        if self._need_preamble:
            if len(self._buf) < PREAMBLE_SIZE:
                if not MAGIC.startswith(bytes(self._buf[:4])):
                    raise ProtocolError("peer is not speaking tdbg (bad magic)")
                return out
            magic, lo, hi = PREAMBLE.unpack_from(self._buf)
            if magic != MAGIC:
                raise ProtocolError("peer is not speaking tdbg (bad magic)")
            self.peer_versions = (lo, hi)
            del self._buf[:PREAMBLE_SIZE]
            self._need_preamble = False
        while True:
            if self._frame_len is None:
                if len(self._buf) < FRAME_HEADER.size:
                    return out
                (length,) = FRAME_HEADER.unpack_from(self._buf)
                if length == 0:
                    raise ProtocolError("zero-length frame")
                if length > self.max_frame:
                    raise ProtocolError(
                        f"frame of {length} bytes exceeds the {self.max_frame}-byte cap"
                    )
                del self._buf[: FRAME_HEADER.size]
                self._frame_len = length
            if len(self._buf) < self._frame_len:
                return out
            payload = bytes(self._buf[: self._frame_len])
            del self._buf[: self._frame_len]
            self._frame_len = None
            message = unpack_payload(payload)
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                raise ProtocolError("message is not a map with a 'type'", ErrorCode.BAD_MESSAGE)
            out.append(message)


def negotiate(client: tuple[int, int], server: tuple[int, int] = (PROTO_MIN, PROTO_MAX)) -> int:
    """The protocol both sides speak, or raise ProtocolError(UNSUPPORTED_VERSION)."""
    proto = min(client[1], server[1])
    if proto < max(client[0], server[0]):
        raise ProtocolError(
            f"protocol versions do not overlap: peer speaks {client[0]}-{client[1]}, "
            f"this side {server[0]}-{server[1]}",
            ErrorCode.UNSUPPORTED_VERSION,
        )
    return proto


def _check_value(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError("message nested too deeply", ErrorCode.BAD_MESSAGE)
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ProtocolError("integer out of range", ErrorCode.BAD_MESSAGE)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError("non-finite number", ErrorCode.BAD_MESSAGE)
    elif isinstance(value, str | bytes):
        if len(value) > MAX_STRING:
            raise ProtocolError("string too long", ErrorCode.BAD_MESSAGE)
    elif isinstance(value, list):
        if len(value) > MAX_ARRAY:
            raise ProtocolError("array too long", ErrorCode.BAD_MESSAGE)
        for item in value:
            _check_value(item, depth + 1)
    elif isinstance(value, dict):
        if len(value) > MAX_ARRAY:
            raise ProtocolError("map too large", ErrorCode.BAD_MESSAGE)
        for key, item in value.items():
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)
    else:
        raise ProtocolError(f"unsupported value type {type(value).__name__}", ErrorCode.BAD_MESSAGE)


def validate_client_message(message: dict[str, Any]) -> dict[str, Any]:
    """Check a decoded client message against the schema (R21); return it or raise ProtocolError."""
    _check_value(message, 1)
    if set(message) != {"type", "id", "args"}:
        raise ProtocolError("a client message has exactly: type, id, args", ErrorCode.BAD_MESSAGE)
    mtype, mid, args = message["type"], message["id"], message["args"]
    if not isinstance(mid, int) or isinstance(mid, bool) or not 0 <= mid < 2**31:
        raise ProtocolError("id must be an integer in [0, 2**31)", ErrorCode.BAD_MESSAGE)
    if mtype not in CLIENT_TYPES:
        raise ProtocolError(f"unknown message type {mtype!r}", ErrorCode.UNKNOWN_COMMAND)
    if not isinstance(args, dict):
        raise ProtocolError("args must be a map", ErrorCode.BAD_MESSAGE)
    unknown = set(args) - CLIENT_TYPES[mtype]
    if unknown:
        raise ProtocolError(
            f"unknown field(s) for {mtype}: {sorted(unknown)}", ErrorCode.BAD_MESSAGE
        )
    if mtype == "hello":
        for key in ("proto_min", "proto_max"):
            value = args.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 65536:
                raise ProtocolError(
                    f"hello.{key} must be an integer 0-65535", ErrorCode.BAD_MESSAGE
                )
        if not isinstance(args.get("client_version", ""), str):
            raise ProtocolError("hello.client_version must be a string", ErrorCode.BAD_MESSAGE)
    elif mtype in COMMANDS:
        message["args"] = command_args(mtype, args)
    return message


def client_message(mtype: str, mid: int, **args: Any) -> dict[str, Any]:
    return {"type": mtype, "id": mid, "args": args}


def hello(client_version: str, proto_min: int = PROTO_MIN, proto_max: int = PROTO_MAX) -> bytes:
    """Everything a client sends first: preamble + hello frame."""
    msg = client_message(
        "hello", 0, proto_min=proto_min, proto_max=proto_max, client_version=client_version
    )
    return preamble(proto_min, proto_max) + pack(msg, MAX_INBOUND_FRAME)


# --- step records -----------------------------------------------------------------------------

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
