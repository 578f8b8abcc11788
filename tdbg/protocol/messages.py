"""Every tdbg message: what each type holds, the command schema (bounds, defaults), validation.

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
from dataclasses import dataclass
from typing import Any

from tdbg.protocol.framing import (
    MAX_INBOUND_FRAME,
    PROTO_MAX,
    PROTO_MIN,
    ErrorCode,
    ProtocolError,
    pack,
    preamble,
)

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
