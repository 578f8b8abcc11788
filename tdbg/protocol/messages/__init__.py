"""Every tdbg message, documented here and typed in the module that owns it (re-exported).

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

Probe -> client (outbound frames are at most 4 MiB). Each has a type (named in brackets): a
TypedDict in :mod:`.run` for the run's own messages; a frozen dataclass with ``from_wire`` /
``to_wire`` for alerts (:mod:`.alert`), jobs and acks (:mod:`.jobs`) and deep-dive results
(:mod:`.results`). The probe builds them with these types; clients read them through
``from_wire`` / the ``read_*`` functions, which never raise on a malformed message (a bad figure
reads as None):

``welcome`` ``{proto, server_version, run: RunInfo}`` — the answer to hello [Welcome]. RunInfo
            is ``{name, pid, rank, host, argv, start_time, cwd, torch, device, commands, socket,
            proto_min, proto_max, stall}``; ``commands`` maps a command this run cannot serve to
            why; ``stall`` is the probe's stall rule (:class:`~tdbg.protocol.stall.StallRule`).
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
``alert``   ``{kind, severity, step, time, message, layers: [str]}``; a stall adds ``where``
            (the frame it is stuck in), ``stack`` and ``collective``; ``history: true`` if
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
``console`` ``{seq, stream: [int], text: [str], open: [[stream, text]], step?, history?}`` — lines
            ``seq``, ``seq + 1``, ... the training process wrote to its stdout (1) or stderr (2);
            ``open``: each stream's unfinished line (a progress bar); a gap in the numbers is
            lines dropped (a flood, or the ring's oldest before a client attached)
            [ConsoleLines, :mod:`.console`].

The node stream (``tdbg bridge --job``: every rank of a job on one node over one ssh
connection) has its own messages, ``node``, ``open``, ``data``, ``close`` and ``notice``, typed in
:mod:`.node` [NodeMessage].
"""

from tdbg.protocol.messages.alert import Alert, alert_message
from tdbg.protocol.messages.commands import (
    CLIENT_TYPES,
    COMMANDS,
    MAX_ARRAY,
    MAX_DEPTH,
    MAX_STRING,
    MUTATING,
    Field,
    client_message,
    command_args,
    default_args,
    hello,
    read_command_args,
    validate_client_message,
)
from tdbg.protocol.messages.jobs import ACTIVE_STATES, FINAL_STATES, JOB_STATES, Ack, Job
from tdbg.protocol.messages.node import (
    ChannelClose,
    ChannelData,
    ChannelOpen,
    NodeHello,
    NodeMessage,
    NodeNotice,
    channel_close,
    channel_data,
    channel_open,
    node_hello,
    node_notice,
    read_node_message,
)
from tdbg.protocol.messages.reports import (
    CudaStats,
    GpuStats,
    HostStats,
    ProbeHealth,
    System,
)
from tdbg.protocol.messages.results import (
    MAX_PROFILE_ROWS,
    PROFILE_TIME_COLUMNS,
    Activations,
    AllocationSite,
    AnomalyResult,
    FileInfo,
    JobResult,
    NanHuntResult,
    NoResult,
    ProfileResult,
    ProfileRow,
    SnapshotResult,
    result_from_wire,
)
from tdbg.protocol.messages.run import (
    MAX_METRIC_NAME,
    MAX_STEP,
    Bye,
    Error,
    LayerPresence,
    Layers,
    Metrics,
    Pong,
    ProbeStats,
    RunInfo,
    StepsHeader,
    Synced,
    WatchedOptimizer,
    Welcome,
    bye_message,
    error_message,
    layers_message,
    metrics_message,
    read_error,
    read_layer_presence,
    read_metrics,
    welcome_message,
)
from tdbg.protocol.messages.updates import LARGE_RATIO, TINY_RATIO, UpdateRatios

__all__ = [
    "LARGE_RATIO",
    "TINY_RATIO",
    "UpdateRatios",
    "ACTIVE_STATES",
    "CLIENT_TYPES",
    "COMMANDS",
    "FINAL_STATES",
    "JOB_STATES",
    "MAX_ARRAY",
    "MAX_DEPTH",
    "MAX_METRIC_NAME",
    "MAX_PROFILE_ROWS",
    "MAX_STEP",
    "MAX_STRING",
    "MUTATING",
    "PROFILE_TIME_COLUMNS",
    "Ack",
    "Activations",
    "Alert",
    "AllocationSite",
    "AnomalyResult",
    "Bye",
    "ChannelClose",
    "ChannelData",
    "ChannelOpen",
    "CudaStats",
    "Error",
    "Field",
    "FileInfo",
    "GpuStats",
    "HostStats",
    "Job",
    "JobResult",
    "LayerPresence",
    "Layers",
    "Metrics",
    "NanHuntResult",
    "NoResult",
    "NodeHello",
    "NodeMessage",
    "NodeNotice",
    "Pong",
    "ProbeHealth",
    "ProbeStats",
    "ProfileResult",
    "ProfileRow",
    "RunInfo",
    "SnapshotResult",
    "StepsHeader",
    "Synced",
    "System",
    "WatchedOptimizer",
    "Welcome",
    "alert_message",
    "bye_message",
    "channel_close",
    "channel_data",
    "channel_open",
    "client_message",
    "command_args",
    "default_args",
    "error_message",
    "hello",
    "layers_message",
    "metrics_message",
    "node_hello",
    "node_notice",
    "read_command_args",
    "read_error",
    "read_layer_presence",
    "read_metrics",
    "read_node_message",
    "result_from_wire",
    "validate_client_message",
    "welcome_message",
]
