"""Every tdbg message: one typed definition each, the command schema, validation and readers.

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

Probe -> client (outbound frames are at most 4 MiB). Each has a TypedDict below (named in
brackets); the probe builds them with these types and clients read them through the ``read_*``
functions, which never raise on a malformed message (a bad figure reads as None):

``welcome`` ``{proto, server_version, run: RunInfo}`` — the answer to hello [Welcome]. RunInfo
            is ``{name, pid, rank, host, argv, start_time, cwd, torch, device, commands, socket,
            proto_min, proto_max}``; ``commands`` maps a command this run cannot serve to why.
``layers``  ``{names: [str], numel: [int], model?: [int], models?: [str], gone?: [int],
            gone_at?: [int], since?: [int]}`` — the layers whose gradients are watched, in the
            order used by every ``grad_norms`` array. Sent before any step [Layers]; sent again
            mid-run when the watched layers change (a layer replaced, a model or optimizer
            added): the list only grows, earlier names keep their index, a batch with fewer
            layers than the latest list has NaN for the rest, ``gone`` lists layers whose
            parameters left the model (``gone_at``: the first step without each) and ``since``
            gives each layer's first step. A NaN norm at a step before a layer's ``since``, or
            from a gone layer's ``gone_at`` on, is no norm at all, not a non-finite gradient.
``steps``   ``{n, layers, lr_groups, history}`` [StepsHeader] and the columns of a batch of step
            records, owned by :mod:`tdbg.protocol.steps` (``pack_steps``/``unpack_steps``);
            ``history: true`` marks batches replayed to a late client. Per-layer norms may be
            present for only some steps (sampled steps, or downsampled history).
``alert``   ``{kind, severity, step, time, message, layers: [str]}``; ``history: true`` if
            replayed [Alert].
``system``  ``{time, host: {...}, cuda: [{...}], gpus: [{...}], missing: [str]}`` — memory and
            device figures; a figure that cannot be measured is absent or ``None`` and ``missing``
            says why (no CUDA, no NVML, ...) [System].
``probe``   ``{time, cost_fraction, grad_interval, grad_mode, overhead_budget, errors,
            last_error, dropped, clients, steps_seen, disabled, rejected_peers, history_bytes,
            activations_every, jobs}`` — the probe's own health and cost [ProbeHealth].
``synced``  ``{}`` — history replay is complete; everything after it is live [Synced].
``pong``    ``{id}`` [Pong].
``error``   ``{code, id, message}`` — a refusal or protocol error (codes: :class:`ErrorCode`)
            [Error].
``bye``     ``{reason}`` — the probe closes this connection (``shutdown``, ``slow_consumer``) [Bye].
``ack``     ``{id, command, job, message}`` — a command was accepted as job number ``job``;
            ``message`` carries warnings (anomaly mode is global and slow) [Ack].
``job``     ``{job, command, state, step, done, total, message, args, trigger, time, result}`` —
            a job's progress [Job]: ``state`` is one of :data:`JOB_STATES`; ``done``/``total``
            count steps; ``result`` (on ``done``) is the command's answer: [ProfileResult],
            [SnapshotResult], [NanHuntResult], [AnomalyResult], or ``{}`` (see docs/dump.md).
            Finished jobs are replayed to late clients with ``history: true``.
``metrics`` ``{points: [[step, name, value], ...]}`` — user metrics (``tdbg.log``, framework
            logs, a loss per optimizer as ``loss/NAME``), in step order [Metrics].
``activations`` ``{step, names, types, mean, std, min, max, zero_frac, nonfinite}`` — per-module
            output statistics of one sampled step; the value lists are in ``names`` order
            [Activations].

The node stream (``tdbg bridge --job``: every rank of a job on one node over one ssh
connection) has its own messages, ``node``, ``open``, ``data``, ``close`` and ``notice``, typed
at the end of this module [NodeMessage].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from tdbg.protocol.framing import (
    MAX_INBOUND_FRAME,
    PROTO_MAX,
    PROTO_MIN,
    ErrorCode,
    ProtocolError,
    pack,
    preamble,
)

if TYPE_CHECKING:  # typing.NotRequired is 3.11+; only the type checker needs it
    from typing import NotRequired

# --- probe -> client: one typed definition per message ----------------------------------------
#
# A figure that cannot be measured is None ("not measured"); readers (the ``read_*`` functions
# below) turn a malformed figure into None as well, so the same types describe what the probe
# builds and what a client may rely on after reading.


class WatchedOptimizer(TypedDict):
    name: str
    type: str  # the optimizer's class name
    groups: int  # its param groups: its lr columns follow the previous optimizers' ones


class RunInfo(TypedDict):
    """Who the run is: built by the probe at watch(), completed when its socket is bound."""

    name: str
    pid: int
    rank: int
    host: str
    argv: list[str]
    start_time: float
    cwd: str
    torch: str
    device: str  # "cpu", "cuda:0", ...
    commands: dict[str, str]  # deep-dive commands this run cannot serve -> why
    # A rank of a distributed job (from the launcher's environment; absent for one process).
    world_size: NotRequired[int]
    local_rank: NotRequired[int]
    job: NotRequired[str]  # the job's id (torchrun's run id, else MASTER_ADDR:PORT)
    # What is watched: model names (layers say which is theirs), optimizers in lr column order.
    models: NotRequired[list[str]]
    optimizers: NotRequired[list[WatchedOptimizer]]
    param_groups: NotRequired[int]  # all optimizers' groups (lr columns are capped: MAX_LR_COLUMNS)
    socket: NotRequired[str]  # set once the socket is bound (absent for a recording-only probe)
    proto_min: NotRequired[int]
    proto_max: NotRequired[int]


class Welcome(TypedDict):
    type: Literal["welcome"]
    proto: int
    server_version: str
    run: RunInfo


def welcome_message(proto: int, server_version: str, run: RunInfo) -> Welcome:
    return {"type": "welcome", "proto": proto, "server_version": server_version, "run": run}


class Layers(TypedDict):
    """The watched layers, in the order of every ``grad_norms`` array; sent before any step."""

    type: Literal["layers"]
    names: list[str]
    numel: list[int]
    model: NotRequired[list[int]]  # per layer: its model's index in ``models``
    models: NotRequired[list[str]]  # the watched models' names (as RunInfo.models, kept current)
    gone: NotRequired[list[int]]  # layers whose parameters left the model: no norms from then on
    # Per layer, the first step that can have its norm (a layer added mid-run: 0 for the
    # others). A NaN norm before it, or from a gone layer's ``gone_at`` on, is no norm at all
    # (the row was read before the layer came, or after it went), not a non-finite one.
    since: NotRequired[list[int]]
    gone_at: NotRequired[list[int]]  # per ``gone`` layer, the first step without its norm


def layers_message(
    names: list[str],
    numel: list[int],
    *,
    model: list[int] | None = None,
    models: list[str] | None = None,
    gone: list[int] | None = None,
    since: list[int] | None = None,
    gone_at: list[int] | None = None,
) -> Layers:
    """The ``layers`` message; ``model`` only with several models, ``gone`` only when not empty,
    ``since`` only when a layer came mid-run."""
    layers: Layers = {"type": "layers", "names": names, "numel": numel}
    if model is not None:
        layers["model"] = model
    if gone:
        layers["gone"] = gone
        if gone_at is not None and len(gone_at) == len(gone):
            layers["gone_at"] = gone_at
    if since and any(since):
        layers["since"] = since
    if models is not None:
        layers["models"] = models
    return layers


MAX_STEP = 1 << 62  # a step number a reader keeps (larger, negative or not an int: ignored)


@dataclass(frozen=True)
class LayerPresence:
    """Which norms of a run's rows are no norm at all, from its latest ``layers`` message:
    layer ``i``'s before ``since[i]`` and, for a gone layer, from ``gone_at[i]`` on."""

    since: tuple[int, ...] = ()  # per layer (empty: none came mid-run)
    gone_at: Mapping[int, int] = field(default_factory=dict)  # gone layer -> first step without

    def __bool__(self) -> bool:
        return bool(self.since) or bool(self.gone_at)

    def window(self, n_layers: int) -> tuple[list[int], list[int]]:
        """Per layer of ``n_layers``, the steps that can have its norm: from ``first`` to
        before ``until`` (MAX_STEP: not gone). A NaN outside them is no norm at all."""
        first = list(self.since) if len(self.since) == n_layers else [0] * n_layers
        until = [MAX_STEP] * n_layers
        for i, step in self.gone_at.items():
            if i < n_layers:
                until[i] = step
        return first, until


def read_layer_presence(message: Any, n_layers: int) -> LayerPresence:
    """A ``layers`` message's ``since``, ``gone`` and ``gone_at``, what is well-formed of them
    (never raises). A gone layer without a ``gone_at`` (an older probe) has no norm at any
    step where it reads NaN."""
    if not isinstance(message, dict):
        return LayerPresence()

    def step(value: Any) -> int | None:
        return value if type(value) is int and 0 <= value < MAX_STEP else None

    raw_since = message.get("since")
    since: tuple[int, ...] = ()
    if isinstance(raw_since, list) and len(raw_since) == n_layers:
        since = tuple(step(v) or 0 for v in raw_since)
    gone, at = message.get("gone"), message.get("gone_at")
    gone_at: dict[int, int] = {}
    if isinstance(gone, list):
        ats = at if isinstance(at, list) and len(at) == len(gone) else [0] * len(gone)
        for i, first in zip(gone, ats, strict=True):
            if type(i) is int and 0 <= i < n_layers:
                gone_at[i] = step(first) or 0
    return LayerPresence(since, gone_at)


class StepsHeader(TypedDict):
    """The header of a ``steps`` batch. Its columns (little-endian binary arrays, one per
    :class:`~tdbg.protocol.steps.StepRecord` field) are owned by :mod:`tdbg.protocol.steps`:
    build and read them only with ``pack_steps`` / ``unpack_steps``."""

    type: Literal["steps"]
    n: int  # records in the batch
    layers: int  # per-layer norms in each row with gradients
    lr_groups: int
    history: bool


class Alert(TypedDict):
    type: Literal["alert"]
    kind: str
    severity: str  # "error" | "warning" | "info"
    step: int
    time: float
    message: str
    layers: list[str]
    stack: NotRequired[list[str]]  # ``stalled``: the training thread's Python stack, innermost last
    # ``stalled`` in a distributed job: the flight recorder's last collective of this rank
    # ({seq, op, sizes, state, group}); the rank with the lowest seq did not enter the others'.
    collective: NotRequired[dict[str, Any]]
    history: NotRequired[bool]
    # Job alerts (``straggler``, ``rank_divergence``, ``hang``), raised by the reader that
    # compares a job's ranks, not by a probe: the ranks named, and ``cleared`` once it is over.
    ranks: NotRequired[list[int]]
    cleared: NotRequired[bool]
    phase: NotRequired[str]  # straggler: what its extra time goes to (input wait, forward, ...)
    slower_by: NotRequired[float]  # straggler: seconds of own work a step over the others
    stacks: NotRequired[dict[str, str]]  # hang: rank -> its training thread's stack


class HostStats(TypedDict):
    rss: int  # bytes
    cpu_percent: float
    ram_used: int
    ram_total: int


class CudaStats(TypedDict):
    """The CUDA caching allocator's figures for one device in use (bytes, counts)."""

    index: int
    name: str
    allocated: int
    reserved: int
    peak: int
    retries: int
    ooms: int


class GpuStats(TypedDict):
    """One GPU as NVML sees it; any figure NVML would not give is None."""

    index: int
    name: str | None
    util: float | None  # percent
    mem_used: int | None  # bytes
    mem_total: int | None
    temp: float | None  # degrees C
    power: float | None  # W
    power_limit: float | None
    sm_clock: int | None  # MHz


class System(TypedDict):
    type: Literal["system"]
    time: float
    host: HostStats
    cuda: list[CudaStats]
    gpus: list[GpuStats]
    missing: list[str]  # why a figure is absent (no CUDA, no NVML, ...)


class ProbeStats(TypedDict):
    """The probe's own figures, as the training side reports them."""

    grad_interval: int
    grad_mode: str  # "auto" | "fixed"
    overhead_budget: float
    errors: int
    last_error: str | None
    steps_seen: int
    disabled: bool  # switched off by the error breaker (not: closed at the end of the run)
    closed: NotRequired[bool]  # the run ended and the probe closed cleanly
    total_steps: NotRequired[int | None]  # optimizer steps the run will take, where known
    skipped_steps: NotRequired[int]  # updates skipped by watch(skip_nonfinite=True)
    amp_skipped_steps: NotRequired[int]  # updates AMP's GradScaler skipped (routine: no alert)


class ProbeHealth(ProbeStats):
    """The 1 Hz ``probe`` message: the probe's health and cost."""

    type: Literal["probe"]
    time: float
    clients: int
    dropped: int
    rejected_peers: int
    history_bytes: int
    cost_fraction: float | None
    activations_every: NotRequired[int | None]  # only where the probe takes commands
    jobs: NotRequired[list[int]]  # job numbers in flight


class Synced(TypedDict):
    type: Literal["synced"]


class Pong(TypedDict):
    type: Literal["pong"]
    id: int


class Error(TypedDict):
    type: Literal["error"]
    code: str  # an ErrorCode
    id: int  # the refused message's id; 0 when it answers no message
    message: str


def error_message(code: str, mid: int, message: str) -> Error:
    return {"type": "error", "code": code, "id": mid, "message": message}


class Bye(TypedDict):
    type: Literal["bye"]
    reason: str  # "shutdown" | "slow_consumer" | "exit 1: <the uncaught exception>"


def bye_message(reason: str) -> Bye:
    return {"type": "bye", "reason": reason}


class AckFields(TypedDict):
    command: str
    job: int
    message: str  # warnings (anomaly mode is global and slow)


class Ack(AckFields):
    type: Literal["ack"]
    id: int


class FileInfo(TypedDict):
    """A file the probe wrote (trace, snapshot)."""

    path: str
    size: int | None
    sha256: str


class ProfileRow(TypedDict):
    """One op of a profile's table: times in microseconds, memory in bytes (the op's own)."""

    name: str
    calls: int | None
    self_cpu: float | None
    cpu_total: float | None
    self_device: float | None
    device_total: float | None
    cpu_memory: int | None
    device_memory: int | None


class ProfileTable(TypedDict):
    rows: list[ProfileRow]  # at most 100, sorted by ``sort``
    sort: str  # "device_total" | "cpu_total"
    device: bool  # device times were recorded
    total_self_cpu: float | None  # over every op, not only the rows sent
    total_self_device: float | None
    truncated: bool  # more ops than rows


MAX_PROFILE_ROWS = 100  # rows a profile sends


def profile_table(rows: list[ProfileRow], device: bool) -> ProfileTable:
    """A profile's table from every op's row: sorted by device total on device runs (CPU total
    otherwise), at most :data:`MAX_PROFILE_ROWS`, and self-time totals over every op (not only
    the rows kept), so a row's share is its self time over the total."""
    sort: Literal["device_total", "cpu_total"] = "device_total" if device else "cpu_total"
    ordered = sorted(rows, key=lambda r: (-(r[sort] or 0.0), -(r["cpu_total"] or 0.0), r["name"]))
    return {
        "rows": ordered[:MAX_PROFILE_ROWS],
        "sort": sort,
        "device": device,
        # rounded to the nanosecond: drops float-summation noise
        "total_self_cpu": round(sum(r["self_cpu"] or 0.0 for r in rows), 3),
        "total_self_device": round(sum(r["self_device"] or 0.0 for r in rows), 3),
        "truncated": len(rows) > MAX_PROFILE_ROWS,
    }


class ProfileResult(ProfileTable):
    steps: list[int]  # [first, last] profiled; [] when unknown
    wall_seconds: float | None
    trace: FileInfo | None  # the Chrome/Perfetto trace


class AllocationSite(TypedDict):
    site: str
    bytes: int | None
    count: int | None


class SnapshotSummary(TypedDict):
    top: list[AllocationSite]  # by size, largest first
    active_bytes: int | None
    reserved_bytes: int | None


class SnapshotResult(SnapshotSummary):
    file: FileInfo | None  # the pickle for https://pytorch.org/memory_viz
    steps: list[int]  # [first, last] recorded; [] when unknown
    history_owner: str  # "tdbg" | "script"


class NanHuntResult(TypedDict):
    found: bool
    phase: str | None  # "forward" | "backward"; None if not found
    module: str | None  # as in named_modules(); "" is the root model
    module_type: str | None
    step: int | None  # where it was found
    nonfinite: int | None
    numel: int | None
    input_min: float | None  # of the module's finite inputs
    input_max: float | None
    input_nonfinite: bool
    params_nonfinite: int | None
    steps_checked: int | None
    trigger: str | None  # "manual" | "auto"


def nan_hunt_result(steps_checked: int, trigger: str, **found: Any) -> NanHuntResult:
    """A NaN hunt's answer: nothing found over ``steps_checked`` steps, unless ``found`` names
    the origin (``found=True, phase=..., module=...``)."""
    result: NanHuntResult = {
        "found": False,
        "phase": None,
        "module": None,
        "module_type": None,
        "step": None,
        "nonfinite": 0,
        "numel": 0,
        "input_min": None,
        "input_max": None,
        "input_nonfinite": False,
        "params_nonfinite": 0,
        "steps_checked": steps_checked,
        "trigger": trigger,
    }
    unknown = set(found) - set(result)
    if unknown:
        raise ValueError(f"not NaN hunt result fields: {sorted(unknown)}")
    result.update(found)  # type: ignore[typeddict-item]
    return result


class AnomalyResult(TypedDict):
    steps: int | None
    check_nan: bool
    errors: int | None  # backward errors seen (each also an ``anomaly`` alert)


class NoResult(TypedDict):
    """The result of a job that has nothing to report (activation statistics turned off)."""


JobResult = ProfileResult | SnapshotResult | NanHuntResult | AnomalyResult | NoResult


class Job(TypedDict):
    """A job's progress, sent to every client; ``result`` only with state ``done``."""

    type: Literal["job"]
    job: int
    command: str
    state: str  # one of JOB_STATES
    step: int | None  # the run's step at this change; None while armed
    done: int  # steps run
    total: int | None  # steps to run; None for activations
    message: str  # a warning, or why it failed or was cancelled
    args: dict[str, Any]  # the command's arguments, defaults filled in
    trigger: str  # "manual" | "auto"
    time: float
    result: JobResult | None
    history: NotRequired[bool]


class Metrics(TypedDict):
    """User metrics (``tdbg.log``, framework logs, per-optimizer losses) as points
    ``[step, name, value]``; a value that is not finite is kept (and alerted on)."""

    type: Literal["metrics"]
    points: list[tuple[int, str, float]]
    history: NotRequired[bool]


class Activations(TypedDict):
    """Per-module output statistics of one sampled step; the value lists are in names order."""

    type: Literal["activations"]
    step: int | None
    names: list[str]
    types: list[str]
    mean: list[float]
    std: list[float]
    min: list[float]
    max: list[float]
    zero_frac: list[float]  # fraction of exact zeros (dead ReLUs)
    nonfinite: list[float]  # counts (whole numbers); NaN where a reader found none
    history: NotRequired[bool]


ProbeMessage = (
    Welcome
    | Layers
    | StepsHeader
    | Alert
    | System
    | ProbeHealth
    | Synced
    | Pong
    | Error
    | Bye
    | Ack
    | Job
    | Activations
    | Metrics
)


# --- client -> probe ---------------------------------------------------------------------------


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


# --- reading probe messages --------------------------------------------------------------------
#
# A client (the TUI, ``tdbg dump``, the CLI's reports) reads what a probe sent through these, never
# through raw keys: each returns the typed message, or None when it is not one at all. They never
# raise: a hostile or buggy probe's malformed figure reads as None (not measured), a malformed
# list entry is dropped, so nothing downstream needs to defend itself again.


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _steps(value: Any) -> list[int]:
    """A ``[first, last]`` pair of steps; [] when either is not a step number."""
    pair = [_int(v) for v in _list(value)]
    if len(pair) != 2 or pair[0] is None or pair[1] is None:
        return []
    return [pair[0], pair[1]]


def read_file_info(value: Any) -> FileInfo | None:
    """A file the probe wrote; None without a path."""
    data = _dict(value)
    path = _str(data.get("path"))
    if not path:
        return None
    return {"path": path, "size": _int(data.get("size")), "sha256": _str(data.get("sha256")) or ""}


PROFILE_TIME_COLUMNS = ("self_cpu", "cpu_total", "self_device", "device_total")


def read_profile_row(value: Any) -> ProfileRow | None:
    """One op of a profile's table; None when it is not a map."""
    if not isinstance(value, dict):
        return None
    return {
        "name": str(value.get("name") or "?"),
        "calls": _int(value.get("calls")),
        "self_cpu": _float(value.get("self_cpu")),
        "cpu_total": _float(value.get("cpu_total")),
        "self_device": _float(value.get("self_device")),
        "device_total": _float(value.get("device_total")),
        "cpu_memory": _int(value.get("cpu_memory")),
        "device_memory": _int(value.get("device_memory")),
    }


def read_profile(value: Any) -> ProfileResult | None:
    """A ``profile`` job's result; None when it is not a map. An unknown ``sort`` reads as the
    probe's default for the run (device total on device runs, CPU total otherwise)."""
    if not isinstance(value, dict):
        return None
    device = bool(value.get("device"))
    sort = _str(value.get("sort"))
    if sort not in PROFILE_TIME_COLUMNS:
        sort = "device_total" if device else "cpu_total"
    return {
        "rows": [r for r in map(read_profile_row, _list(value.get("rows"))) if r is not None],
        "sort": sort,
        "device": device,
        "total_self_cpu": _float(value.get("total_self_cpu")),
        "total_self_device": _float(value.get("total_self_device")),
        "truncated": bool(value.get("truncated")),
        "steps": _steps(value.get("steps")),
        "wall_seconds": _float(value.get("wall_seconds")),
        "trace": read_file_info(value.get("trace")),
    }


def read_snapshot(value: Any) -> SnapshotResult | None:
    """A ``snapshot`` job's result; None when it is not a map."""
    if not isinstance(value, dict):
        return None
    top: list[AllocationSite] = [
        {
            "site": str(entry.get("site") or "?"),
            "bytes": _int(entry.get("bytes")),
            "count": _int(entry.get("count")),
        }
        for entry in _list(value.get("top"))
        if isinstance(entry, dict)
    ]
    return {
        "top": top,
        "active_bytes": _int(value.get("active_bytes")),
        "reserved_bytes": _int(value.get("reserved_bytes")),
        "file": read_file_info(value.get("file")),
        "steps": _steps(value.get("steps")),
        "history_owner": _str(value.get("history_owner")) or "tdbg",
    }


def read_nan_hunt(value: Any) -> NanHuntResult | None:
    """A ``nan_hunt`` job's result; None when it is not a map."""
    if not isinstance(value, dict):
        return None
    return {
        "found": bool(value.get("found")),
        "phase": _str(value.get("phase")),
        "module": _str(value.get("module")),
        "module_type": _str(value.get("module_type")),
        "step": _int(value.get("step")),
        "nonfinite": _int(value.get("nonfinite")),
        "numel": _int(value.get("numel")),
        "input_min": _float(value.get("input_min")),
        "input_max": _float(value.get("input_max")),
        "input_nonfinite": bool(value.get("input_nonfinite")),
        "params_nonfinite": _int(value.get("params_nonfinite")),
        "steps_checked": _int(value.get("steps_checked")),
        "trigger": _str(value.get("trigger")),
    }


def read_anomaly(value: Any) -> AnomalyResult | None:
    """An ``anomaly`` job's result; None when it is not a map."""
    if not isinstance(value, dict):
        return None
    return {
        "steps": _int(value.get("steps")),
        "check_nan": bool(value.get("check_nan")),
        "errors": _int(value.get("errors")),
    }


def read_result(command: str, value: Any) -> JobResult | None:
    """A done job's result read by its command's type; None when it is not a map."""
    reader = {
        "profile": read_profile,
        "snapshot": read_snapshot,
        "nan_hunt": read_nan_hunt,
        "anomaly": read_anomaly,
    }.get(command)
    if reader is not None:
        return reader(value)
    return {} if isinstance(value, dict) else None


def read_command_args(command: str, value: Any) -> dict[str, Any]:
    """A job's ``args`` as its command's schema types them: a field the schema does not know,
    or one out of its bounds, is left out."""
    schema = COMMANDS.get(command, {})
    out: dict[str, Any] = {}
    for name, raw in _dict(value).items():
        spec = schema.get(name)
        if spec is None:
            continue
        try:
            out[name] = spec.check(command, name, raw)
        except ProtocolError:
            continue
    return out


def read_job(message: Any) -> Job | None:
    """A ``job`` message; None without a job number. ``command`` is "" when missing (a later
    message of the same job names it), ``result`` is read by the command's type."""
    data = _dict(message)
    number = _int(data.get("job"))
    if number is None:
        return None
    command = _str(data.get("command")) or ""
    job: Job = {
        "type": "job",
        "job": number,
        "command": command,
        "state": _str(data.get("state")) or "?",
        "step": _int(data.get("step")),
        "done": _int(data.get("done")) or 0,
        "total": _int(data.get("total")),
        "message": str(data.get("message") or ""),
        "args": read_command_args(command, data.get("args")),
        "trigger": _str(data.get("trigger")) or "manual",
        "time": _float(data.get("time")) or 0.0,
        "result": read_result(command, data.get("result")),
    }
    if data.get("history"):
        job["history"] = True
    return job


def read_ack(message: Any) -> Ack | None:
    """An ``ack``; None without the id of the command it answers."""
    data = _dict(message)
    mid = _int(data.get("id"))
    if mid is None:
        return None
    job = _int(data.get("job"))
    return {
        "type": "ack",
        "id": mid,
        "command": _str(data.get("command")) or "command",
        "job": 0 if job is None else job,
        "message": str(data.get("message") or ""),
    }


def read_error(message: Any) -> Error:
    """An ``error``; ``id`` 0 when it answers no message (a protocol error)."""
    data = _dict(message)
    return {
        "type": "error",
        "code": str(data.get("code") or "ERROR"),
        "id": _int(data.get("id")) or 0,
        "message": str(data.get("message") or ""),
    }


ACTIVATION_STATS = ("mean", "std", "min", "max", "zero_frac", "nonfinite")


def read_activations(message: Any) -> Activations | None:
    """An ``activations`` message with every value list as long as ``names``: a missing or
    malformed value reads as NaN, a missing type as ""."""
    data = _dict(message)
    if not data:
        return None
    names = [str(n) for n in _list(data.get("names"))]
    n = len(names)
    types = [str(t) for t in _list(data.get("types"))][:n]
    types += [""] * (n - len(types))

    def column(key: str) -> list[float]:
        values = [_float(v) for v in _list(data.get(key))[:n]]
        out = [math.nan if v is None else v for v in values]
        return out + [math.nan] * (n - len(out))

    out: Activations = {
        "type": "activations",
        "step": _int(data.get("step")),
        "names": names,
        "types": types,
        "mean": column("mean"),
        "std": column("std"),
        "min": column("min"),
        "max": column("max"),
        "zero_frac": column("zero_frac"),
        "nonfinite": column("nonfinite"),
    }
    if data.get("history"):
        out["history"] = True
    return out


class ProbeCommandState(TypedDict, total=False):
    """What a ``probe`` message says about commands, where it says it."""

    activations_every: int | None
    jobs: list[int]


def read_probe_commands(message: Any) -> ProbeCommandState:
    """The activation interval and the jobs in flight from a ``probe`` message (each only when
    the message carries it)."""
    data = _dict(message)
    out: ProbeCommandState = {}
    if "activations_every" in data:
        out["activations_every"] = _int(data.get("activations_every"))
    if "jobs" in data:
        out["jobs"] = [j for j in map(_int, _list(data.get("jobs"))) if j is not None]
    return out


# --- builders: the probe and the synthetic source make these messages the same way -----------


def alert_message(
    kind: str, severity: str, step: int, message: str, layers: Sequence[str], time: float
) -> Alert:
    """An ``alert``: ``kind`` started at ``step`` (see docs/dump.md for the kinds)."""
    return {
        "type": "alert",
        "kind": kind,
        "severity": severity,
        "step": step,
        "time": time,
        "message": message,
        "layers": list(layers),
    }


def job_message(
    job: int,
    command: str,
    state: str,
    step: int | None,
    time: float,
    *,
    done: int = 0,
    total: int | None = None,
    message: str = "",
    args: dict[str, Any] | None = None,
    trigger: str = "manual",
    result: JobResult | None = None,
) -> Job:
    """A ``job`` message: job ``job``'s progress, with its result when ``state`` is done."""
    return {
        "type": "job",
        "job": job,
        "command": command,
        "state": state,
        "step": step,
        "done": done,
        "total": total,
        "message": message,
        "args": {} if args is None else args,
        "trigger": trigger,
        "time": time,
        "result": result,
    }


MAX_METRIC_NAME = 64  # characters of a metric's name kept (longer names are cut)


def metrics_message(points: Sequence[tuple[int, str, float]]) -> Metrics:
    """A ``metrics`` message of ``(step, name, value)`` points, in the order given."""
    return {"type": "metrics", "points": [(int(s), str(n), float(v)) for s, n, v in points]}


def read_metrics(message: Any) -> list[tuple[int, str, float]]:
    """A ``metrics`` message's points; a malformed point (no step, no name, not a number) is
    dropped, a non-finite value is kept."""
    out: list[tuple[int, str, float]] = []
    for point in _list(_dict(message).get("points")):
        fields = _list(point)
        if len(fields) != 3:
            continue
        step, name, value = _int(fields[0]), _str(fields[1]), _float(fields[2])
        if step is None or not name or value is None:
            continue
        out.append((step, name[:MAX_METRIC_NAME], value))
    return out


# --- the node stream: every rank of a job on one node over one ssh connection ------------------
#
# ``tdbg bridge --job JOB`` answers with NODE_MAGIC's preamble (framing.py), then frames of these
# messages both ways. Each rank's connection is a numbered channel whose probe-protocol bytes ride
# as opaque ``data`` chunks: the bridge never parses a probe's frame.
#
# bridge -> client: ``node`` (first: who answers), ``open`` (a rank's socket was reached: a new
# channel and the run's metadata), ``data``, ``close`` (the rank's socket closed), ``notice``.
# client -> bridge: ``data`` (to the rank's probe) and ``close`` (the client left that rank).


class NodeHello(TypedDict):
    type: Literal["node"]
    tdbg: str  # the bridge's tdbg version
    protocol: list[int]  # [min, max] probe protocol versions it knows
    host: str
    runtime_dir: str
    job: str


class ChannelOpen(TypedDict):
    type: Literal["open"]
    ch: int
    run: dict[str, Any]  # the rank's run metadata, as `tdbg bridge --list` prints it


class ChannelData(TypedDict):
    type: Literal["data"]
    ch: int
    data: bytes


class ChannelClose(TypedDict):
    type: Literal["close"]
    ch: int
    reason: str


class NodeNotice(TypedDict):
    type: Literal["notice"]
    message: str


NodeMessage = NodeHello | ChannelOpen | ChannelData | ChannelClose | NodeNotice


def node_hello(
    tdbg: str, protocol: tuple[int, int], host: str, runtime_dir: str, job: str
) -> NodeHello:
    return {
        "type": "node",
        "tdbg": tdbg,
        "protocol": [protocol[0], protocol[1]],
        "host": host,
        "runtime_dir": runtime_dir,
        "job": job,
    }


def channel_open(ch: int, run: dict[str, Any]) -> ChannelOpen:
    return {"type": "open", "ch": ch, "run": run}


def channel_data(ch: int, data: bytes) -> ChannelData:
    return {"type": "data", "ch": ch, "data": data}


def channel_close(ch: int, reason: str = "closed") -> ChannelClose:
    return {"type": "close", "ch": ch, "reason": reason}


def node_notice(message: str) -> NodeNotice:
    return {"type": "notice", "message": message}


def read_node_message(message: Any) -> NodeMessage | None:
    """A node-stream message read by its type; None when it is malformed or of another type
    (a peer newer than us may send more kinds: they are skipped, never fatal)."""
    data = _dict(message)
    kind = data.get("type")
    if kind == "node":
        versions = [_int(v) for v in _list(data.get("protocol"))]
        lo, hi = (versions + [None, None])[:2]
        return node_hello(
            _str(data.get("tdbg")) or "?",
            (lo or 0, hi or 0),
            _str(data.get("host")) or "",
            _str(data.get("runtime_dir")) or "",
            _str(data.get("job")) or "",
        )
    if kind == "notice":
        return node_notice(_str(data.get("message")) or "")
    ch = _int(data.get("ch"))
    if ch is None:
        return None
    if kind == "open" and isinstance(data.get("run"), dict):
        return channel_open(ch, dict(data["run"]))
    if kind == "data" and isinstance(data.get("data"), bytes):
        return channel_data(ch, data["data"])
    if kind == "close":
        return channel_close(ch, _str(data.get("reason")) or "closed")
    return None
