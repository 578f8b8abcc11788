"""Probe -> client messages about the run: welcome, layers, steps, system, probe health, metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from tdbg.protocol.messages.tolerant import as_dict, as_float, as_int, as_list, as_str

if TYPE_CHECKING:  # typing.NotRequired is 3.11+; only the type checker needs it
    from typing import NotRequired

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
    launcher: NotRequired[str]  # what started the rank, as `tdbg run` recognised it ("torchrun")
    # What is watched: model names (layers say which is theirs), optimizers in lr column order.
    models: NotRequired[list[str]]
    optimizers: NotRequired[list[WatchedOptimizer]]
    param_groups: NotRequired[int]  # all optimizers' groups (lr columns are capped: MAX_LR_COLUMNS)
    socket: NotRequired[str]  # set once the socket is bound (absent for a recording-only probe)
    proto_min: NotRequired[int]
    proto_max: NotRequired[int]
    stall: NotRequired[dict[str, float]]  # the probe's StallRule.to_wire(): when a gap is a stall


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
    # The model summary, per layer (tdbg.probe.training.layer_facts): the owning module's class,
    # its parameters' dtypes and devices ("+"-joined when they differ), bytes, elements with
    # requires_grad, and the index in the run's ``optimizers`` of the one updating it (-1: none).
    types: NotRequired[list[str]]
    dtypes: NotRequired[list[str]]
    devices: NotRequired[list[str]]
    bytes: NotRequired[list[int]]
    trainable: NotRequired[list[int]]
    optimizer: NotRequired[list[int]]
    # Per layer, the index among each step's ``lr`` columns of the param group updating it
    # (-1: none): a layer whose group's learning rate is 0 learns nothing.
    lr_group: NotRequired[list[int]]


# The model summary's per-layer columns in the ``layers`` message, by name.
SUMMARY_FIELDS = ("types", "dtypes", "devices", "bytes", "trainable", "optimizer", "lr_group")


def layers_message(
    names: list[str],
    numel: list[int],
    *,
    model: list[int] | None = None,
    models: list[str] | None = None,
    gone: list[int] | None = None,
    since: list[int] | None = None,
    gone_at: list[int] | None = None,
    facts: Mapping[str, list[str] | list[int]] | None = None,
) -> Layers:
    """The ``layers`` message; ``model`` only with several models, ``gone`` only when not empty,
    ``since`` only when a layer came mid-run; ``facts``: the model summary's columns, each kept
    only when it has one entry per layer."""
    layers: Layers = {"type": "layers", "names": names, "numel": numel}
    for key in SUMMARY_FIELDS:
        column = (facts or {}).get(key)
        if column is not None and len(column) == len(names):
            layers[key] = list(column)  # type: ignore[literal-required]
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


_TEXT_FIELDS = frozenset({"types", "dtypes", "devices"})


def read_layer_facts(message: Any, n_layers: int) -> dict[str, list[Any]]:
    """The ``layers`` message's summary columns that are whole and well typed (one entry per
    layer: strings, or ints that are not bools); any other is left out, not guessed."""
    facts: dict[str, list[Any]] = {}
    if not isinstance(message, dict):
        return facts
    for key in SUMMARY_FIELDS:
        column = message.get(key)
        if not isinstance(column, list) or len(column) != n_layers:
            continue
        if key in _TEXT_FIELDS:
            if all(isinstance(v, str) for v in column):
                facts[key] = [str(v) for v in column]
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in column):
            facts[key] = [int(v) for v in column]
    return facts


class StepsHeader(TypedDict):
    """The header of a ``steps`` batch. Its columns (little-endian binary arrays, one per
    :class:`~tdbg.protocol.steps.StepRecord` field) are owned by :mod:`tdbg.protocol.steps`:
    build and read them only with ``pack_steps`` / ``unpack_steps``."""

    type: Literal["steps"]
    n: int  # records in the batch
    layers: int  # per-layer norms in each row with gradients
    lr_groups: int
    history: bool


class ProbeStats(TypedDict):
    """The probe's own figures, as the training side hands them to the probe thread (which
    sends them in its ``probe`` report, :class:`~tdbg.protocol.messages.reports.ProbeHealth`)."""

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


def read_error(message: Any) -> Error:
    """An ``error``; ``id`` 0 when it answers no message (a protocol error)."""
    data = as_dict(message)
    return {
        "type": "error",
        "code": str(data.get("code") or "ERROR"),
        "id": as_int(data.get("id")) or 0,
        "message": str(data.get("message") or ""),
    }


class Metrics(TypedDict):
    """User metrics (``tdbg.log``, framework logs, per-optimizer losses) as points
    ``[step, name, value]``; a value that is not finite is kept (and alerted on)."""

    type: Literal["metrics"]
    points: list[tuple[int, str, float]]
    history: NotRequired[bool]


MAX_METRIC_NAME = 64  # characters of a metric's name kept (longer names are cut)


def metrics_message(points: Sequence[tuple[int, str, float]]) -> Metrics:
    """A ``metrics`` message of ``(step, name, value)`` points, in the order given."""
    return {"type": "metrics", "points": [(int(s), str(n), float(v)) for s, n, v in points]}


def read_metrics(message: Any) -> list[tuple[int, str, float]]:
    """A ``metrics`` message's points; a malformed point (no step, no name, not a number) is
    dropped, a non-finite value is kept."""
    out: list[tuple[int, str, float]] = []
    for point in as_list(as_dict(message).get("points")):
        fields = as_list(point)
        if len(fields) != 3:
            continue
        step, name, value = as_int(fields[0]), as_str(fields[1]), as_float(fields[2])
        if step is None or not name or value is None:
            continue
        out.append((step, name[:MAX_METRIC_NAME], value))
    return out
