"""Client -> probe messages: hello, the command schema (bounds, defaults, help) and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

from tdbg.protocol.framing import (
    MAX_INBOUND_FRAME,
    PROTO_MAX,
    PROTO_MIN,
    ErrorCode,
    ProtocolError,
    pack,
    preamble,
)
from tdbg.protocol.messages.tolerant import as_dict


class HelloArgs(TypedDict):
    proto_min: int
    proto_max: int
    client_version: str


class ClientMessage(TypedDict):
    """Every client message: a ``type``, an ``id`` and the ``args`` of that type."""

    type: str
    id: int
    args: dict[str, Any]


# Schema bounds for client messages (guarantees: wire).
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
    """One command argument: its type (``int``, ``float`` or ``bool``), bounds, default, and
    how a user reads it (``help``; ``metavar`` names a number's placeholder). Every front end
    (the CLI's options, the TUI's forms) takes these from here."""

    kind: type
    default: int | float | bool | None
    lo: float = 0
    hi: float = 0
    help: str = ""
    metavar: str = "N"

    @property
    def bounds(self) -> str:
        """``1-200``: the accepted range, as the refusal and the help both spell it."""
        return f"{self.lo:g}-{self.hi:g}"

    @property
    def expected(self) -> str:
        """What a value must be: ``an integer 1-200``, ``a number 1-120``, ``true or false``."""
        if self.kind is bool:
            return "true or false"
        return f"{'an integer' if self.kind is int else 'a number'} {self.bounds}"

    def parse(self, text: str) -> int | float:
        """A number typed by a user (a command-line option), checked against the bounds;
        raises ValueError saying what it must be."""
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"must be {self.expected}") from None
        if not self.lo <= value <= self.hi:
            raise ValueError(f"must be {self.expected}")
        return value

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
            raise ProtocolError(f"{where} must be {self.expected}", ErrorCode.BAD_MESSAGE)
        return self.kind(value)


# The static allowlist of commands, every argument typed and bounded (docs/guarantees.md,
# commands).
COMMANDS: dict[str, dict[str, Field]] = {
    "profile": {
        "steps": Field(int, 5, 1, 200, "steps to profile"),
        "max_seconds": Field(float, 30.0, 1, 120, "wall-clock cap on the profiled steps", "S"),
        "record_shapes": Field(bool, False, help="record input shapes"),
        "profile_memory": Field(bool, False, help="record allocations"),
        "with_stack": Field(bool, False, help="record Python stacks"),
    },
    "snapshot": {
        "steps": Field(int, 3, 1, 50, "steps to record"),
        "max_entries": Field(int, 100_000, 1000, 100_000, "allocator events kept"),
    },
    "nan_hunt": {"steps": Field(int, 1, 1, 100, "steps to watch at most")},
    "anomaly": {
        "steps": Field(int, 10, 1, 50, "steps with anomaly mode on"),
        "check_nan": Field(
            bool,
            False,
            help="also raise on NaN in backward (only where watch(anomaly_check_nan=True) "
            "allows it)",
        ),
    },
    "activations": {
        "every": Field(int, 10, 1, 10_000, "sample every K steps", "K"),
        "enabled": Field(bool, True, help="false turns activation statistics off"),
    },
    "cancel": {"job": Field(int, None, 1, 2**31 - 1, "the job to cancel", "JOB")},
}

CLIENT_TYPES.update({name: frozenset(schema) for name, schema in COMMANDS.items()})
# Commands that change the training process's state: refused read-only, audit-logged.
MUTATING = frozenset(COMMANDS) - {"cancel"}


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
    """Check a decoded client message against the schema (docs/guarantees.md, wire); return it
    or raise ProtocolError."""
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
        # Named by repr, sorted as text: the keys may be of any types msgpack decodes (a
        # str beside a bytes one is not orderable).
        named = ", ".join(sorted(repr(key) for key in unknown))
        raise ProtocolError(f"unknown field(s) for {mtype}: {named}", ErrorCode.BAD_MESSAGE)
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


def read_command_args(command: str, value: Any) -> dict[str, Any]:
    """A job's ``args`` as its command's schema types them: a field the schema does not know,
    or one out of its bounds, is left out."""
    schema = COMMANDS.get(command, {})
    out: dict[str, Any] = {}
    for name, raw in as_dict(value).items():
        spec = schema.get(name)
        if spec is None:
            continue
        try:
            out[name] = spec.check(command, name, raw)
        except ProtocolError:
            continue
    return out


def default_args(command: str) -> dict[str, Any]:
    """The command's arguments as the probe fills them in when a client sends none (a front
    end that sends a command without a form takes these: the schema owns the defaults)."""
    return command_args(command, {})
