"""A run's wire messages as the JSON events ``tdbg dump`` prints (documented in docs/dump.md)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from tdbg.cli.dump_console import console_events, event_line
from tdbg.connect.client import ProbeClient
from tdbg.format import finite as finite
from tdbg.format import finite_tree as finite_tree
from tdbg.format import unfinite as unfinite
from tdbg.protocol.messages import LayerPresence, read_layer_presence, read_metrics
from tdbg.protocol.messages.histograms import Histograms, bin_labels
from tdbg.protocol.messages.results import Activations, result_from_wire
from tdbg.protocol.messages.run import read_layer_facts
from tdbg.protocol.messages.updates import UpdateRatios
from tdbg.protocol.steps import PHASES, unpack_steps
from tdbg.recording.reader import Recording, open_recording

if TYPE_CHECKING:  # numpy: loaded by `dump --job` only, which judges the job
    from tdbg.model.job_alerts import JobAlert


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else value


def _count(value: float) -> int | float | None:
    """A count or index sent as f64: an int when whole, null when NaN (not known)."""
    if math.isnan(value):
        return None
    return int(value) if math.isfinite(value) and value == int(value) else finite(value)


def metric_events(msg: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One ``metric`` JSON object per point of a ``metrics`` message (``tdbg.log``, framework
    logs, ``loss/NAME``); a non-finite value is kept as "nan" / "inf"."""
    history = bool(msg.get("history"))
    for step, name, value in read_metrics(msg):
        event: dict[str, Any] = {
            "type": "metric",
            "step": step,
            "name": name,
            "value": finite(value),
        }
        if history:
            event["history"] = True
        yield event


def step_events(
    msg: dict[str, Any], layers: list[str], presence: LayerPresence | None = None
) -> Iterator[dict[str, Any]]:
    """One ``step`` JSON object per record of a ``steps`` message. A layer with no norm in a
    row (a NaN where the ``layers`` message's ``presence`` says it had not come or had gone)
    is left out of that step's ``grad_norms``, not written as ``"nan"``."""
    history = bool(msg.get("history"))
    first, until = (presence or LayerPresence()).window(len(layers))
    for rec in unpack_steps(msg):
        norms = None
        if rec.grad_norms is not None:
            step = rec.step
            norms = {
                name: finite(v)
                for i, (name, v) in enumerate(zip(layers, rec.grad_norms, strict=False))
                if v == v or first[i] <= step < until[i]
            }
        event: dict[str, Any] = {
            "type": "step",
            "step": rec.step,
            "time": rec.time,
            "loss": finite(rec.loss),
            "lr": [finite(v) for v in rec.lr],
            "grad_norm": finite(rec.grad_total) if rec.grad_norms is not None else None,
            "grad_norms": norms,
            "step_time": _seconds(rec.step_time),
            "samples": _seconds(rec.samples),
            "tokens": _seconds(rec.tokens),
            **{phase: _seconds(getattr(rec, phase)) for phase in PHASES},
            "probe_time": _seconds(rec.probe_time),
            # What the step was (null where unknown: an older probe or recording).
            "micro_batches": _count(rec.micro_batches),
            "clip_max": _seconds(rec.clip_max),
            "clip_norm": finite(rec.clip_norm) if not math.isnan(rec.clip_norm) else None,
            "epoch": _count(rec.epoch),
        }
        if history:
            event["history"] = True
        yield event


JOB_FIELDS = ("job", "command", "state", "step", "done", "total", "message", "args", "time")


def job_event(msg: dict[str, Any]) -> dict[str, Any]:
    """The ``job`` event of a ``job`` message: its progress fields, without the result."""
    event: dict[str, Any] = {"type": "job"}
    event.update({k: finite_tree(msg.get(k)) for k in JOB_FIELDS})
    if "trigger" in msg:
        event["trigger"] = msg["trigger"]
    if msg.get("history"):
        event["history"] = True
    return event


def result_event(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a ``done`` job as an event typed by its command (``profile``, ``snapshot``,
    ``nan_hunt``, ``anomaly``): ``job``, ``step`` and ``time`` of the job message, then the
    result's own fields (a result's ``step``, as nan_hunt's, wins). None for other states."""
    command = str(msg.get("command"))
    read = result_from_wire(command, msg.get("result"))  # typed: a malformed figure is null
    if msg.get("state") != "done" or read is None:
        return None
    result = read.to_wire()
    event: dict[str, Any] = {
        "type": command,
        "job": msg.get("job"),
        "step": msg.get("step"),
        "time": msg.get("time"),
    }
    event.update(finite_tree(result))
    event["type"] = command
    if msg.get("history"):
        event["history"] = True
    return event


ACTIVATION_STATS = ("mean", "std", "min", "max", "zero_frac", "nonfinite")


def activations_event(msg: dict[str, Any]) -> dict[str, Any]:
    """An ``activations`` message (parallel lists) as ``{step, layers: {name: {type, stats}}}``;
    with its histograms, each module's ``hist`` (counts in the bins ``bins`` names, ``null``:
    not counted) and ``hist_stride``."""
    names = [str(n) for n in msg.get("names") or []]
    types = list(msg.get("types") or [])
    columns = {k: list(msg.get(k) or []) for k in ACTIVATION_STATS}
    sample = Activations.from_wire(msg) if "hist" in msg else None
    layers: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        row: dict[str, Any] = {"type": str(types[i]) if i < len(types) else None}
        for key, values in columns.items():
            row[key] = finite(values[i]) if i < len(values) else None
        if sample is not None and sample.hist:
            counts = sample.hist[i]
            row["hist"] = None if counts is None else list(counts)
            row["hist_stride"] = sample.hist_stride[i]
        layers[name] = row
    event: dict[str, Any] = {"type": "activations", "step": msg.get("step"), "layers": layers}
    if sample is not None and sample.hist:
        event["bins"] = list(bin_labels())
    if msg.get("history"):
        event["history"] = True
    return event


def dump_events(
    client: ProbeClient,
    timeout: float | None,
    tap: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Translate the wire into the documented JSON events (see docs/dump.md); ``tap`` sees each
    wire message first (``--job`` folds them into the job's model to judge it)."""
    hello: dict[str, Any] = {
        "type": "hello",
        "run": client.run,
        "proto": client.welcome.get("proto"),
        "server_version": client.welcome.get("server_version"),
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    messages = _messages_until(client, deadline)
    if tap is not None:
        messages = _tapped(messages, tap)
    ended = yield from _ranked(message_events(messages, hello), client.run)
    if not ended:
        timed_out = deadline is not None and time.monotonic() >= deadline
        yield {"type": "end", "reason": "timeout" if timed_out else "disconnected"}


def recording_events(recording: Recording) -> Iterator[dict[str, Any]]:
    """A recording's messages as the same JSON events as a live run; ``hello`` also names the
    file (``recording``) and when it was made (``recorded``). The ``end`` event's reason is
    ``shutdown`` (the run closed it), ``killed`` (cut short: no end marker, or a last write
    cut off) or ``damaged`` (a checksum mismatch or garbage; ``recording.stopped`` says where)."""
    hello: dict[str, Any] = {
        "type": "hello",
        "run": finite_tree(recording.run),
        "proto": recording.proto,
        "server_version": recording.header.get("tdbg"),
        "recording": str(recording.path),
        "recorded": recording.created,
    }
    events = message_events(recording.messages(), hello, always_hello=True)
    ended = yield from _ranked(events, recording.run)
    if not ended:
        yield {"type": "end", "reason": "damaged" if recording.damaged else "killed"}


def _ranked(
    events: Generator[dict[str, Any], None, bool], run: dict[str, Any]
) -> Generator[dict[str, Any], None, bool]:
    """A distributed job's events each carry the rank's ``rank``, so the streams of several
    ranks can be merged (or grepped) and still say whose each event is."""
    rank = run.get("rank") if isinstance(run.get("world_size"), int) else None
    if rank is None:
        return (yield from events)
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            return bool(stop.value)
        event.setdefault("rank", rank)
        yield event


def message_events(
    messages: Iterable[dict[str, Any]], hello: dict[str, Any], always_hello: bool = False
) -> Generator[dict[str, Any], None, bool]:
    """The JSON events of any message iterator (a socket, a recording); ``hello`` (without its
    layers) is completed from the first ``layers`` message. Returns True when a ``bye`` ended
    it (its ``end`` event is yielded), False when the messages just ran out."""
    layers: list[str] = []
    presence = LayerPresence()
    hello = dict(hello, layers=layers, numel=[])
    for msg in messages:
        mtype = msg.get("type")
        if mtype == "layers":
            # The probe sends its layers right after welcome: hello carries them.
            layers[:] = [str(n) for n in msg.get("names", [])]
            presence = read_layer_presence(msg, len(layers))
            watched: dict[str, Any] = {
                k: finite_tree(msg[k]) for k in ("model", "models") if k in msg
            }
            if presence.gone_at:  # as read: what is malformed of them is not echoed
                watched["gone"] = sorted(presence.gone_at)
                watched["gone_at"] = [presence.gone_at[i] for i in watched["gone"]]
            if presence.since:
                watched["since"] = list(presence.since)
            # The model summary's columns, as read (whole and well typed only).
            watched.update(read_layer_facts(msg, len(layers)))
            if hello:
                hello["numel"] = msg.get("numel", [])
                hello.update(watched)
                yield hello
                hello = {}
            else:
                yield {
                    "type": "layers",
                    "layers": list(layers),
                    "numel": msg.get("numel", []),
                    **watched,
                }
            continue
        if hello:
            yield hello
            hello = {}
        if mtype == "steps":
            yield from step_events(msg, layers, presence)
        elif mtype == "alert":
            yield {k: finite_tree(v) for k, v in msg.items()}
        elif mtype == "system":
            yield {
                "type": "memory",
                "time": msg.get("time"),
                "host": msg.get("host"),
                "cuda": msg.get("cuda", []),
                "missing": msg.get("missing", []),
            }
            yield {
                "type": "gpu",
                "time": msg.get("time"),
                "gpus": msg.get("gpus", []),
                "missing": [m for m in msg.get("missing", []) if m.startswith("GPU")],
            }
        elif mtype == "probe":
            yield {k: finite_tree(v) for k, v in msg.items()}
        elif mtype == "job":
            yield job_event(msg)
            result = result_event(msg)
            if result is not None:
                yield result
        elif mtype == "activations":
            yield activations_event(msg)
        elif mtype == "updates":
            event = updates_event(msg, layers)
            if event is not None:
                yield event
        elif mtype == "histograms":
            event = histograms_event(msg, layers)
            if event is not None:
                yield event
        elif mtype == "metrics":
            yield from metric_events(msg)
        elif mtype == "console":
            yield from console_events(msg)
        elif mtype == "synced":
            yield {"type": "synced"}
        elif mtype == "bye":
            yield {"type": "end", "reason": msg.get("reason")}
            return True
        elif mtype == "error":
            yield {"type": "error", "code": msg.get("code"), "message": msg.get("message")}
    if hello and always_hello:  # a recording without messages still says which run it was
        yield hello
    return False


def updates_event(msg: dict[str, Any], layers: list[str]) -> dict[str, Any] | None:
    """An ``updates`` message as its event: the step and each measured layer's ratio by name
    (``"nan"`` where its weights were zero); None when it is malformed."""
    measured = UpdateRatios.from_wire(msg)
    if measured is None:
        return None
    ratios = {
        layers[i] if i < len(layers) else f"layer {i}": r
        for i, r in zip(measured.layers, measured.ratios, strict=True)
    }
    event: dict[str, Any] = {"type": "updates", "step": measured.step, "ratios": ratios}
    if measured.history:
        event["history"] = True
    return finite_tree(event)


def histograms_event(msg: dict[str, Any], layers: list[str]) -> dict[str, Any] | None:
    """A ``histograms`` message as its event: the bins' labels and, per counted layer by name,
    its weight and gradient counts (``null``: not counted), largest magnitudes and stride;
    None when it is malformed."""
    counted = Histograms.from_wire(msg)
    if counted is None:
        return None
    by_layer = {
        (layers[h.layer] if h.layer < len(layers) else f"layer {h.layer}"): {
            "weights": None if h.weights is None else list(h.weights),
            "grads": None if h.grads is None else list(h.grads),
            "weight_max": h.weight_max,
            "grad_max": h.grad_max,
            "stride": h.stride,
        }
        for h in counted.layers
    }
    event: dict[str, Any] = {
        "type": "histograms",
        "step": counted.step,
        "bins": list(bin_labels()),
        "layers": by_layer,
    }
    if counted.history:
        event["history"] = True
    return finite_tree(event)


def _tapped(
    messages: Iterator[dict[str, Any]], tap: Callable[[dict[str, Any]], None]
) -> Iterator[dict[str, Any]]:
    for msg in messages:
        tap(msg)
        yield msg


def job_alert_event(alert: JobAlert, job: str, history: bool) -> dict[str, Any]:
    """A ``job_alert`` event: a finding about the whole job (a straggler, diverged ranks, NaN on
    some ranks, a hang) raised once it holds, or ``cleared`` once it is gone, as the TUI's job
    screen shows it; ``history`` while some rank was still replaying what came before."""
    finding = alert.finding
    event: dict[str, Any] = {
        "type": "job_alert",
        "job": job,
        "kind": alert.kind,
        "severity": alert.severity,
        "ranks": list(alert.ranks),
        "step": alert.step,
        "time": alert.time,
        "message": alert.message,
        "layers": list(finding.layers),
        "cleared": alert.cleared,
    }
    if finding.phase is not None:
        event["phase"] = finding.phase
    if finding.slower_by is not None:
        event["slower_by"] = finite(finding.slower_by)
    if finding.collective is not None:
        event["collective"] = finite_tree(finding.collective)
    if finding.stacks:
        event["stacks"] = {str(rank): text for rank, text in finding.stacks.items()}
    if history:
        event["history"] = True
    return event


def _messages_until(client: ProbeClient, deadline: float | None) -> Iterator[dict[str, Any]]:
    """The client's messages until it closes or ``deadline`` passes (quiet spells included)."""
    if deadline is None:
        yield from client.messages()
        return
    while not client.peer_closed and time.monotonic() < deadline:
        for msg in client.messages(timeout=max(0.05, min(0.5, deadline - time.monotonic()))):
            yield msg
            if time.monotonic() >= deadline:
                return


def dump_recording(path: str, out: TextIO, window: Window, console: bool = False) -> int:
    """``tdbg dump FILE``: a recording as JSON lines on ``out`` (``console``: its console's
    lines as text); where a damaged or cut-short file stopped goes to stderr. Raises
    RecordingError when the file is not a recording."""
    recording = open_recording(path)
    ended = False
    for event in windowed(recording_events(recording), window):
        line = event_line(event, console)
        if line is not None:
            out.write(line)
        ended = event["type"] == "end"
    out.flush()
    note = recording.end_note
    if ended and note is not None:
        print(f"tdbg: {note}", file=sys.stderr)
    return 0


# --- which part of the stream to print: --follow, --last N, --count N ----------------------


@dataclass(frozen=True)
class Window:
    """Which part of a run ``tdbg dump`` prints: its history (all of it, none, or the events of
    its last ``last`` steps), then its live events (until ``count`` live steps, or for good).

    Everything a run sends before ``synced`` is history; a recording is all history."""

    history: bool = True
    last: int | None = None  # with history: only the last N steps of it (None: all)
    live: bool = True
    count: int | None = None  # stop after this many live steps (a recording: steps)

    @classmethod
    def of(cls, follow: bool, last: int | None, count: int | None) -> Window:
        """``--follow``: no history; ``--last N``: the last N steps of it, then live only with
        ``--follow`` or ``--count``; ``--count N``: N live steps (no history unless ``--last``)."""
        history = last is not None or not (follow or count is not None)
        live = last is None or follow or count is not None
        return cls(history=history, last=last, live=live, count=count)

    @classmethod
    def of_recording(cls, last: int | None, count: int | None) -> Window:
        """A recording is all history: ``--last N`` its last N steps, ``--count N`` its first
        N steps (of the last ones, with both)."""
        return cls(history=True, last=last, live=True, count=count)


def windowed(events: Iterable[dict[str, Any]], window: Window) -> Iterator[dict[str, Any]]:
    """The events of ``window``: the history cut as asked, then live events until ``count``
    live steps (a recording's steps all count) or the end."""
    if not window.history:
        events = _live_only(events)
    elif window.last is not None:
        events = _last_steps(events, window.last)
    live = False
    steps = 0
    for event in events:
        etype = event["type"]
        if etype == "synced" and not window.live:
            yield event
            return  # the history was all that was asked for
        yield event
        live = live or etype == "synced"
        if etype == "step" and window.count is not None and (live or "history" not in event):
            steps += 1
            if steps >= window.count:
                return


def _live_only(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``hello`` (it names the run and its layers), then what comes from ``synced`` on; an
    ``end`` or ``error`` before it too (the run went away while its history was sent)."""
    live = False
    for event in events:
        live = live or event["type"] == "synced"
        if live or event["type"] in ("hello", "end", "error"):
            yield event


def _last_steps(events: Iterable[dict[str, Any]], n: int) -> Iterator[dict[str, Any]]:
    """The history (up to ``synced``, or a recording's ``end``) cut to its last ``n`` steps and
    what happened in them, then everything after it as it comes."""
    buffered: list[dict[str, Any]] = []
    iterator = iter(events)
    boundary: dict[str, Any] | None = None
    for event in iterator:
        if event["type"] in ("synced", "end"):
            boundary = event
            break
        buffered.append(event)
    yield from _cut(buffered, n)
    if boundary is not None:
        yield boundary
        yield from iterator


def _cut(history: list[dict[str, Any]], n: int) -> Iterator[dict[str, Any]]:
    """``history`` without what came before its last ``n`` steps. Step events are cut by
    position (a restarted run's steps start over); other events by their own ``step``, else
    their ``time`` (memory, a job still armed); events with neither (hello, layers) stay."""
    positions = [i for i, event in enumerate(history) if event["type"] == "step"]
    if len(positions) <= n:
        yield from history
        return
    first = positions[-n]
    first_step = history[first].get("step")
    first_time = history[first].get("time")
    for i, event in enumerate(history):
        if event["type"] == "step":
            keep = i >= first
        elif isinstance(event.get("step"), int | float) and isinstance(first_step, int | float):
            keep = event["step"] >= first_step
        elif isinstance(event.get("time"), int | float) and isinstance(first_time, int | float):
            keep = event["time"] >= first_time
        else:
            keep = True
        if keep:
            yield event
