"""The ``tdbg`` (dump, ls, tui, profile, snapshot, nan-hunt, anomaly, activations) and ``tdbg-tui``
entry points; never imports torch, and imports rich only where a table is printed."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

from tdbg import __version__
from tdbg.client import (
    CommandRefused,
    CommandTimeout,
    ConnectError,
    ProbeClient,
    resolve_target,
)
from tdbg.protocol import COMMANDS, FINAL_STATES, ProtocolError, unpack_steps
from tdbg.runtime import discover, runtime_dir

EXIT_FAILED = 1  # a deep-dive job ended failed or cancelled (its reason is on stderr)
EXIT_USAGE = 2  # bad arguments, no run, refused command, timeout, run ended mid-job
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A one-line error for the user; exit code 2."""


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _finite_tree(value: Any) -> Any:
    """:func:`_finite` through nested maps and lists (command results, activation stats)."""
    if isinstance(value, dict):
        return {str(k): _finite_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_tree(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return _finite(value)


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else value


def step_events(msg: dict[str, Any], layers: list[str]) -> Iterator[dict[str, Any]]:
    """One ``step`` JSON object per record of a ``steps`` message."""
    history = bool(msg.get("history"))
    for rec in unpack_steps(msg):
        norms = None
        if rec.grad_norms is not None:
            norms = {name: _finite(v) for name, v in zip(layers, rec.grad_norms, strict=False)}
        event: dict[str, Any] = {
            "type": "step",
            "step": rec.step,
            "time": rec.time,
            "loss": _finite(rec.loss),
            "lr": [_finite(v) for v in rec.lr],
            "grad_norm": _finite(rec.grad_total) if rec.grad_norms is not None else None,
            "grad_norms": norms,
            "step_time": _seconds(rec.step_time),
            "samples": _seconds(rec.samples),
            "tokens": _seconds(rec.tokens),
            "data_time": _seconds(rec.data_time),
            "forward_time": _seconds(rec.forward_time),
            "backward_time": _seconds(rec.backward_time),
            "optimizer_time": _seconds(rec.optimizer_time),
            "probe_time": _seconds(rec.probe_time),
        }
        if history:
            event["history"] = True
        yield event


JOB_FIELDS = ("job", "command", "state", "step", "done", "total", "message", "args", "time")


def job_event(msg: dict[str, Any]) -> dict[str, Any]:
    """The ``job`` event of a ``job`` message: its progress fields, without the result."""
    event: dict[str, Any] = {"type": "job"}
    event.update({k: _finite_tree(msg.get(k)) for k in JOB_FIELDS})
    if "trigger" in msg:
        event["trigger"] = msg["trigger"]
    if msg.get("history"):
        event["history"] = True
    return event


def result_event(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a ``done`` job as an event typed by its command (``profile``, ``snapshot``,
    ``nan_hunt``, ``anomaly``): ``job``, ``step`` and ``time`` of the job message, then the
    result's own fields (a result's ``step``, as nan_hunt's, wins). None for other states."""
    result = msg.get("result")
    if msg.get("state") != "done" or not isinstance(result, dict):
        return None
    event: dict[str, Any] = {
        "type": str(msg.get("command")),
        "job": msg.get("job"),
        "step": msg.get("step"),
        "time": msg.get("time"),
    }
    event.update(_finite_tree(result))
    event["type"] = str(msg.get("command"))
    if msg.get("history"):
        event["history"] = True
    return event


ACTIVATION_STATS = ("mean", "std", "min", "max", "zero_frac", "nonfinite")


def activations_event(msg: dict[str, Any]) -> dict[str, Any]:
    """An ``activations`` message (parallel lists) as ``{step, layers: {name: {type, stats}}}``."""
    names = [str(n) for n in msg.get("names") or []]
    types = list(msg.get("types") or [])
    columns = {k: list(msg.get(k) or []) for k in ACTIVATION_STATS}
    layers: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        row: dict[str, Any] = {"type": str(types[i]) if i < len(types) else None}
        for key, values in columns.items():
            row[key] = _finite(values[i]) if i < len(values) else None
        layers[name] = row
    event: dict[str, Any] = {"type": "activations", "step": msg.get("step"), "layers": layers}
    if msg.get("history"):
        event["history"] = True
    return event


def dump_events(client: ProbeClient, timeout: float | None) -> Iterator[dict[str, Any]]:
    """Translate the wire into the documented JSON events (see docs/dump.md)."""
    layers: list[str] = []
    hello: dict[str, Any] = {
        "type": "hello",
        "run": client.run,
        "proto": client.welcome.get("proto"),
        "server_version": client.welcome.get("server_version"),
        "layers": layers,
        "numel": [],
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    for msg in _messages_until(client, deadline):
        mtype = msg.get("type")
        if mtype == "layers":
            # The probe sends its layers right after welcome: hello carries them.
            layers[:] = [str(n) for n in msg.get("names", [])]
            if hello:
                hello["numel"] = msg.get("numel", [])
                yield hello
                hello = {}
            else:
                yield {"type": "layers", "layers": list(layers), "numel": msg.get("numel", [])}
            continue
        if hello:
            yield hello
            hello = {}
        if mtype == "steps":
            yield from step_events(msg, layers)
        elif mtype == "alert":
            yield {k: _finite_tree(v) for k, v in msg.items()}
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
            yield {k: _finite_tree(v) for k, v in msg.items()}
        elif mtype == "job":
            yield job_event(msg)
            result = result_event(msg)
            if result is not None:
                yield result
        elif mtype == "activations":
            yield activations_event(msg)
        elif mtype == "synced":
            yield {"type": "synced"}
        elif mtype == "bye":
            yield {"type": "end", "reason": msg.get("reason")}
            return
        elif mtype == "error":
            yield {"type": "error", "code": msg.get("code"), "message": msg.get("message")}
    timed_out = deadline is not None and time.monotonic() >= deadline
    yield {"type": "end", "reason": "timeout" if timed_out else "disconnected"}


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


def pick_target(target: str | None, wait: float | None) -> str:
    """The socket to attach to: the given target, or the only live run (waiting for one)."""
    if target is not None:
        return resolve_target(target)
    deadline = time.monotonic() + (wait or 0.0)
    while True:
        entries = discover()
        if len(entries) == 1:
            return str(entries[0].socket)
        if len(entries) > 1:
            listing = "; ".join(f"{e.socket} ({e.name})" for e in entries[:4])
            raise CliError(f"{len(entries)} runs found, name one: {listing}")
        if time.monotonic() >= deadline:
            raise CliError(f"no tdbg run found in {runtime_dir()} (start one with tdbg.watch)")
        time.sleep(0.2)


def cmd_dump(args: argparse.Namespace, out: TextIO) -> int:
    path = pick_target(args.target, args.timeout)
    client = ProbeClient.connect(path)
    steps = 0
    try:
        for event in dump_events(client, args.timeout):
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
            if event["type"] == "step":
                steps += 1
                if args.count is not None and steps >= args.count:
                    break
            out.flush()
    finally:
        client.close()
    out.flush()
    return 0


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    entries = discover()
    if args.json:
        for e in entries:
            out.write(json.dumps(dict(e.meta, socket=str(e.socket))) + "\n")
        return 0
    if not entries:
        out.write(f"no tdbg runs in {runtime_dir()}\n")
        return 0
    for e in entries:
        started = time.strftime("%H:%M:%S", time.localtime(float(e.meta.get("start_time", 0))))
        out.write(
            f"{e.name:<20} pid {e.pid:<8} rank {e.meta.get('rank', 0):<3} "
            f"started {started}  {e.socket}\n"
        )
    return 0


def cmd_tui(args: argparse.Namespace, out: TextIO) -> int:
    from tdbg.tui.app import launch  # textual is loaded only for the TUI

    return launch(args.target)


# --- deep-dive commands: profile, snapshot, nan-hunt, anomaly, activations -------------------


def _format_us(us: Any) -> str:
    """Microseconds as a short human figure: 812 us, 3.41 ms, 1.20 s."""
    if not isinstance(us, int | float) or isinstance(us, bool):
        return "n/a"
    if not math.isfinite(us):
        return str(_finite(float(us)))
    a = abs(us)
    if a == 0:
        return "0"
    if a < 1000:
        return f"{us:.3g} us" if a < 100 else f"{us:.0f} us"
    if a < 1_000_000:
        return f"{us / 1000:.3g} ms"
    return f"{us / 1_000_000:.3g} s"


def _format_bytes(n: Any) -> str:
    """Bytes with a binary unit; negative (memory freed) keeps its sign."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "n/a"
    if n == 0:
        return "0"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def _format_number(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(_finite(v))
    return str(v)


def _console(out: TextIO) -> Any:
    """A rich console on ``out``: no markup (op names hold brackets), 160 columns when piped."""
    from rich.console import Console  # rich is loaded only where a table is printed

    isatty = getattr(out, "isatty", lambda: False)()
    width = None if isatty or os.environ.get("COLUMNS") else 160
    return Console(file=out, width=width, markup=False, highlight=False, emoji=False)


PROFILE_COLUMNS = (
    "name",
    "calls",
    "self_cpu",
    "cpu_total",
    "self_device",
    "device_total",
    "cpu_memory",
    "device_memory",
    "share",
)


def profile_rows(result: dict[str, Any], sort: str | None = None) -> list[dict[str, Any]]:
    """The result's rows with their ``share`` of the profiled time (fraction 0-1), sorted by
    ``sort`` (a row field or ``share``; default: the probe's own order). Numbers sort
    descending, names ascending."""
    device = bool(result.get("device"))
    key = "self_device" if device else "self_cpu"
    total = result.get("total_self_device" if device else "total_self_cpu") or 0.0
    rows = []
    for row in result.get("rows") or []:
        own = row.get(key) or 0.0
        rows.append(dict(row, share=(own / total) if total else None))
    if sort is None or sort == result.get("sort"):
        return rows
    if sort == "name":
        return sorted(rows, key=lambda r: str(r.get("name", "")))
    return sorted(rows, key=lambda r: -(r.get(sort) or 0.0))


def print_profile(
    result: dict[str, Any], out: TextIO, sort: str | None = None, limit: int = 20
) -> None:
    """The top-ops table (device columns only on device runs), then the trace's path."""
    from rich.table import Table

    device = bool(result.get("device"))
    rows = profile_rows(result, sort)
    steps = result.get("steps") or [None, None]
    shown_sort = sort or result.get("sort") or "cpu_total"
    title = (
        f"profile of steps {steps[0]}-{steps[-1]}, {_format_number(result.get('wall_seconds'))} s"
        f" wall, sorted by {shown_sort}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("op", no_wrap=True, overflow="ellipsis", min_width=12, max_width=60)
    headers = ["calls", "self CPU", "CPU total"]
    if device:
        headers += ["self device", "device total"]
    headers += ["CPU mem"]
    if device:
        headers += ["device mem"]
    headers += ["share %"]
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows[:limit]:
        cells = [str(row.get("name", "")), str(row.get("calls", ""))]
        cells += [_format_us(row.get("self_cpu")), _format_us(row.get("cpu_total"))]
        if device:
            cells += [_format_us(row.get("self_device")), _format_us(row.get("device_total"))]
        cells.append(_format_bytes(row.get("cpu_memory")))
        if device:
            cells.append(_format_bytes(row.get("device_memory")))
        share = row.get("share")
        cells.append("n/a" if share is None else f"{100 * share:.1f}")
        table.add_row(*cells)
    notes = []
    if len(rows) > limit:
        notes.append(f"{len(rows) - limit} more ops (--rows)")
    if result.get("truncated"):
        notes.append("the probe sent its top 100 ops only")
    if not device:
        notes.append("CPU-only run: no device columns")
    if notes:
        table.caption = "; ".join(notes)
        table.caption_justify = "left"
    console = _console(out)
    console.print(table)
    trace = result.get("trace")
    if isinstance(trace, dict) and trace.get("path"):
        # soft_wrap: a path is never broken across lines (scripts and terminals pick it up).
        console.print(
            f"trace: {trace['path']} ({_format_bytes(trace.get('size'))})", soft_wrap=True
        )
    else:
        console.print("trace: none written")


def print_snapshot(result: dict[str, Any], out: TextIO, limit: int = 10) -> None:
    """The snapshot file and the top allocation sites by size."""
    from rich.table import Table

    console = _console(out)
    file = result.get("file") or {}
    steps = result.get("steps") or [None, None]
    console.print(
        f"snapshot: {file.get('path')} ({_format_bytes(file.get('size'))})", soft_wrap=True
    )
    console.print(
        f"steps {steps[0]}-{steps[-1]}: active {_format_bytes(result.get('active_bytes'))}, "
        f"reserved {_format_bytes(result.get('reserved_bytes'))}"
    )
    top = list(result.get("top") or [])
    if top:
        table = Table(title="top allocation sites", title_justify="left")
        table.add_column("bytes", justify="right", no_wrap=True)
        table.add_column("count", justify="right", no_wrap=True)
        table.add_column("site", overflow="fold")
        for site in top[:limit]:
            table.add_row(
                _format_bytes(site.get("bytes")), str(site.get("count", "")), str(site.get("site"))
            )
        console.print(table)
    console.print("open it at https://pytorch.org/memory_viz")


def format_nan_hunt(result: dict[str, Any]) -> str:
    """What the hunt found, as lines of text."""
    checked = result.get("steps_checked")
    if not result.get("found"):
        return f"no non-finite value in {checked} step{'s' if checked != 1 else ''}\n"
    module = result.get("module")
    name = "the root model" if module == "" else str(module)
    lines = [
        f"first non-finite {result.get('phase')} value: {name} ({result.get('module_type')}) "
        f"at step {result.get('step')}",
        f"  non-finite elements:    {result.get('nonfinite')} of {result.get('numel')}",
        f"  input min / max:        {_format_number(result.get('input_min'))} / "
        f"{_format_number(result.get('input_max'))}",
        f"  inputs already non-finite: {'yes' if result.get('input_nonfinite') else 'no'}",
        f"  non-finite parameters:  {result.get('params_nonfinite')}",
        f"  steps checked: {checked} ({result.get('trigger')})",
    ]
    return "\n".join(lines) + "\n"


def format_anomaly(result: dict[str, Any], alerts: Sequence[dict[str, Any]]) -> str:
    """Anomaly mode's summary, then every backward error's forward traceback."""
    errors = result.get("errors") or 0
    lines = [
        f"anomaly mode done: {result.get('steps')} steps, check_nan "
        f"{'on' if result.get('check_nan') else 'off'}, "
        f"{errors} backward error{'s' if errors != 1 else ''}"
    ]
    for alert in alerts:
        lines.append(f"--- step {alert.get('step')}: {alert.get('severity', 'error')}")
        lines.append(str(alert.get("message", "")).rstrip())
    return "\n".join(lines) + "\n"


def print_activations(event: dict[str, Any], out: TextIO) -> None:
    """One sampled step's per-layer output statistics (an ``activations`` event)."""
    from rich.table import Table

    table = Table(title=f"activations at step {event.get('step')}", title_justify="left")
    table.add_column("module", no_wrap=True, overflow="ellipsis", max_width=60)
    table.add_column("type", no_wrap=True)
    for header in ("mean", "std", "min", "max", "zero %", "non-finite"):
        table.add_column(header, justify="right", no_wrap=True)
    for name, row in (event.get("layers") or {}).items():
        zero = row.get("zero_frac")
        table.add_row(
            name or "(root)",
            str(row.get("type") or ""),
            *(_format_number(row.get(k)) for k in ("mean", "std", "min", "max")),
            f"{100 * zero:.1f}" if isinstance(zero, int | float) else _format_number(zero),
            _format_number(row.get("nonfinite")),
        )
    _console(out).print(table)


def progress_line(msg: dict[str, Any]) -> str:
    """A job message as one line of progress for stderr."""
    head = f"{msg.get('command')} job {msg.get('job')}"
    state = msg.get("state")
    if state == "armed":
        text = "armed, waiting for the next step boundary"
    elif state == "running":
        total = msg.get("total")
        text = f"running {msg.get('done')}/{total if total is not None else '-'}"
        if msg.get("step") is not None:
            text += f" (step {msg.get('step')})"
    else:
        text = str(state)
    if msg.get("message") and state not in ("armed", "running", "done"):
        # armed repeats the ack's note and running its k/N; analysing and the end say more.
        text += f": {msg['message']}"
    return f"{head}: {text}"


class JobFailed(Exception):
    """The job ended failed or cancelled; exit code 1 with its reason."""


class JobWatch:
    """Follows one job's ``job`` messages on a client until it ends, the run ends or time is up.

    Also keeps live ``anomaly`` alerts (their messages hold the forward traceback) and the
    first live ``activations`` message after the command was accepted.
    """

    def __init__(
        self,
        client: ProbeClient,
        command: str,
        timeout: float,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.command = command
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.progress = progress
        self.job: int | None = None
        self.ack: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.alerts: list[dict[str, Any]] = []
        self.activations: dict[str, Any] | None = None
        self.cancel_on_abort = True  # cancel the job on a timeout or Ctrl-C
        self._synced = False
        self._shown: tuple[Any, ...] | None = None

    def start(self, **args: Any) -> dict[str, Any]:
        """Send the command and wait for its ack (CliError on a refusal or no answer)."""
        try:
            mid = self.client.send(self.command, **args)
        except OSError:  # not BrokenPipeError for run(): that one means stdout went away
            raise CliError(
                f"the run closed the connection before {self.command} was sent"
            ) from None
        try:
            self.ack = self.client.reply(mid, self.command, max(0.1, self._left()))
        except CommandRefused as exc:
            raise CliError(f"{self.command} refused: {exc}") from None
        except CommandTimeout as exc:
            if self.client.peer_closed:
                raise CliError(f"the run ended before it answered {self.command}") from None
            raise CliError(str(exc)) from None
        except KeyboardInterrupt:
            # Learn the job number if the ack is on its way, so it can be cancelled.
            try:
                self.ack = self.client.reply(mid, self.command, 2.0)
            except (CommandRefused, CommandTimeout, OSError, ProtocolError):
                raise KeyboardInterrupt from None
            self.job = int(self.ack.get("job") or 0) or None
            self._interrupted()
            raise
        self.job = int(self.ack.get("job") or 0) or None
        return self.ack

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _take(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Note one message; return it when it is this job's final ``job`` message."""
        mtype = msg.get("type")
        if mtype == "synced":
            self._synced = True
        if msg.get("history"):
            return None
        if mtype == "job" and self.job is not None and msg.get("job") == self.job:
            self.last = msg
            key = (msg.get("state"), msg.get("done"))
            if self.progress is not None and key != self._shown:
                self._shown = key
                self.progress(progress_line(msg))
            if msg.get("state") in FINAL_STATES:
                return msg
        elif mtype == "alert" and msg.get("kind") == "anomaly":
            self.alerts.append(msg)
        elif mtype == "activations" and self._synced and self.activations is None:
            self.activations = msg
        elif mtype == "bye":
            self._ended(str(msg.get("reason") or "closed"))
        return None

    def _ended(self, reason: str) -> NoReturn:
        what = f"{self.command} job {self.job}"
        state = (self.last or {}).get("state", "armed")
        if state in FINAL_STATES:
            state = f"{state}: {(self.last or {}).get('message') or 'no reason given'}"
        if reason == "slow_consumer":
            raise CliError(f"the probe dropped this client as too slow while {what} was {state}")
        raise CliError(f"the run ended before {what} finished (it was {state})")

    def wait(self, until: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """Read until the job ends (return its final message), or ``until()`` holds (None).

        CliError when the time is up (the job is cancelled first) or the run ends; JobFailed
        when the job failed or was cancelled. Ctrl-C cancels the job and re-raises.
        """
        try:
            while True:
                if until is not None and until():
                    return None
                left = self._left()
                if left <= 0:
                    self._timed_out()
                for msg in self.client.messages(timeout=min(0.5, max(0.01, left))):
                    final = self._take(msg)
                    if final is not None:
                        return self._finish(final)
                    if (until is not None and until()) or self._left() <= 0:
                        break
                if self.client.peer_closed:
                    self._ended("closed")
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def _interrupted(self) -> None:
        if self.cancel_on_abort and self.cancel():
            print(f"tdbg: interrupted: {self.command} job {self.job} cancelled", file=sys.stderr)

    def _finish(self, final: dict[str, Any]) -> dict[str, Any]:
        if final.get("state") == "done":
            return final
        # A run that ends cancels its jobs, then says bye at once: that is "the run ended"
        # (exit 2), not a job that failed or was cancelled on its own (exit 1).
        linger = time.monotonic() + 0.5
        while time.monotonic() < linger and not self.client.peer_closed:
            for msg in self.client.messages(timeout=max(0.01, linger - time.monotonic())):
                if msg.get("type") == "bye":
                    self._ended(str(msg.get("reason") or "closed"))
                if time.monotonic() >= linger:
                    break
        if self.client.peer_closed:
            self._ended("closed")
        reason = final.get("message") or "no reason given"
        raise JobFailed(f"{self.command} job {self.job} {final.get('state')}: {reason}")

    def _timed_out(self) -> NoReturn:
        state = (self.last or {}).get("state", "armed")
        cancelled = "; cancelled" if self.cancel_on_abort and self.cancel() else ""
        if state == "armed":
            raise CliError(
                f"the run did not reach a step boundary within {self.timeout:g} s "
                f"({self.command} job {self.job} was armed{cancelled})"
            )
        raise CliError(
            f"{self.command} job {self.job} did not finish within {self.timeout:g} s "
            f"(it was {state}{cancelled})"
        )

    def cancel(self) -> bool:
        """Ask the probe to cancel the job (best effort, waits up to 2 s for the answer);
        True when the probe accepted."""
        if self.job is None or self.client.peer_closed:
            return False
        if self.last is not None and self.last.get("state") in FINAL_STATES:
            return False
        try:
            self.client.command("cancel", timeout=2.0, job=self.job)
        except (CommandRefused, CommandTimeout, OSError, ProtocolError):
            return False
        return True


def _progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Progress lines on stderr: with --progress, or by default when stderr is a terminal."""
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if not show:
        return None
    return lambda line: print(f"tdbg: {line}", file=sys.stderr, flush=True)


def _note(ack: dict[str, Any]) -> None:
    if ack.get("message"):
        print(f"tdbg: note: {ack['message']}", file=sys.stderr, flush=True)


def _write_json(out: TextIO, value: Any) -> None:
    out.write(json.dumps(_finite_tree(value), separators=(",", ":")) + "\n")


def _run_job(
    args: argparse.Namespace, command: str, timeout: float, **cmd_args: Any
) -> tuple[JobWatch, dict[str, Any]]:
    """Attach, send ``command``, follow its job to the end; return the watch and result."""
    path = pick_target(args.target, None)
    client = ProbeClient.connect(path)
    watch = JobWatch(client, command, timeout, _progress(args))
    try:
        _note(watch.start(**cmd_args))
        final = watch.wait()
        assert final is not None
        if command == "anomaly":
            # Each backward error is also an alert; give late ones a moment to arrive.
            errors = int((final.get("result") or {}).get("errors") or 0)
            watch.deadline = min(watch.deadline, time.monotonic() + 2.0)
            with contextlib.suppress(CliError):
                watch.wait(until=lambda: len(watch.alerts) >= errors)
        return watch, dict(final.get("result") or {})
    finally:
        client.close()


def cmd_profile(args: argparse.Namespace, out: TextIO) -> int:
    timeout = args.timeout or args.max_seconds + 60.0
    _, result = _run_job(
        args,
        "profile",
        timeout,
        steps=args.steps,
        max_seconds=args.max_seconds,
        record_shapes=args.record_shapes,
        profile_memory=args.profile_memory,
        with_stack=args.with_stack,
    )
    if args.json:
        _write_json(out, result)
    else:
        print_profile(result, out, args.sort, args.rows)
    return 0


def cmd_snapshot(args: argparse.Namespace, out: TextIO) -> int:
    _, result = _run_job(
        args, "snapshot", args.timeout or 120.0, steps=args.steps, max_entries=args.max_entries
    )
    if args.json:
        _write_json(out, result)
    else:
        print_snapshot(result, out, args.rows)
    return 0


def cmd_nan_hunt(args: argparse.Namespace, out: TextIO) -> int:
    _, result = _run_job(args, "nan_hunt", args.timeout or 120.0, steps=args.steps)
    if args.json:
        _write_json(out, result)
    else:
        out.write(format_nan_hunt(result))
    return 0


def cmd_anomaly(args: argparse.Namespace, out: TextIO) -> int:
    watch, result = _run_job(
        args, "anomaly", args.timeout or 120.0, steps=args.steps, check_nan=args.check_nan
    )
    if args.json:
        _write_json(out, dict(result, alerts=watch.alerts))
    else:
        out.write(format_anomaly(result, watch.alerts))
    return 0


def cmd_activations(args: argparse.Namespace, out: TextIO) -> int:
    path = pick_target(args.target, None)
    client = ProbeClient.connect(path)
    timeout = args.timeout or 60.0
    watch = JobWatch(client, "activations", timeout, _progress(args))
    # Statistics stay on after this command returns: giving up waiting must not turn them off.
    watch.cancel_on_abort = False
    try:
        if args.off:
            ack = watch.start(enabled=False)
            _note(ack)
            if args.json:
                _write_json(out, {"enabled": False, "job": ack.get("job")})
            else:
                out.write("activation statistics off\n")
            return 0
        ack = watch.start(every=args.every, enabled=True)
        _note(ack)
        if not args.show:
            if args.json:
                _write_json(out, {"enabled": True, "every": args.every, "job": ack.get("job")})
            else:
                out.write(
                    f"activation statistics every {args.every} steps (job {ack.get('job')}); "
                    "see them with tdbg dump or tdbg-tui, stop with tdbg activations --off\n"
                )
            return 0
        try:
            watch.wait(until=lambda: watch.activations is not None)
        except JobFailed as exc:
            raise CliError(str(exc)) from None
        except CliError:
            if watch.activations is None and watch._left() <= 0:
                raise CliError(f"no sampled step within {timeout:g} s") from None
            raise
        assert watch.activations is not None
        event = activations_event(watch.activations)
        if args.json:
            _write_json(out, event)
        else:
            print_activations(event, out)
        return 0
    finally:
        client.close()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump): ``tdbg profile: error: ...``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bounded(command: str, name: str) -> Callable[[str], Any]:
    """An argparse type checking a value against the protocol's bounds for command.name."""
    spec = COMMANDS[command][name]

    def parse(text: str) -> Any:
        kind = "an integer" if spec.kind is int else "a number"
        try:
            value = spec.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind} {spec.lo:g}-{spec.hi:g}") from None
        if not spec.lo <= value <= spec.hi:
            raise argparse.ArgumentTypeError(f"must be {kind} {spec.lo:g}-{spec.hi:g}")
        return value

    parse.__name__ = f"{command}.{name}"
    return parse


def _sort_column(text: str) -> str:
    column = text.strip().lower().replace("-", "_")
    column = {"op": "name", "self_gpu": "self_device", "gpu_total": "device_total"}.get(
        column, column
    )
    if column not in PROFILE_COLUMNS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(PROFILE_COLUMNS)}")
    return column


def _job_parser(
    sub: Any, name: str, help_text: str, timeout_help: str, func: Callable[..., int]
) -> argparse.ArgumentParser:
    """A deep-dive subcommand with the options they all share."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("target", nargs="?", help="socket path, run .json or directory")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        help=f"give up (cancelling the job) after S seconds; {timeout_help}",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress lines on stderr (default: when stderr is a terminal)",
    )
    p.set_defaults(func=func)
    return p


JOB_EPILOG = (
    "Exit status: 0 done; 1 the job failed or was cancelled; 2 bad arguments, no run, command "
    "refused, timeout, or the run ended first; 130 interrupted (the job is cancelled)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tdbg", description="tdbg: live PyTorch training monitor")
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump = sub.add_parser("dump", help="print a run's events as JSON lines")
    dump.add_argument("target", nargs="?", help="socket path, run .json or directory")
    dump.add_argument("--count", type=_positive_int, help="stop after N step events")
    dump.add_argument(
        "--timeout",
        type=_positive_float,
        help="wait at most S seconds for a run and stop after S seconds",
    )
    dump.set_defaults(func=cmd_dump)
    ls = sub.add_parser("ls", help="list live runs on this machine")
    ls.add_argument("--json", action="store_true", help="one JSON object per run")
    ls.set_defaults(func=cmd_ls)
    tui = sub.add_parser("tui", help="the full-screen monitor (same as tdbg-tui)")
    tui.add_argument("target", nargs="?", help="socket path, run .json or directory")
    tui.set_defaults(func=cmd_tui)

    profile = _job_parser(
        sub,
        "profile",
        "torch.profiler over the next N steps: the top-ops table and the trace's path",
        "default: --max-seconds + 60",
        cmd_profile,
    )
    profile.add_argument(
        "--steps",
        type=_bounded("profile", "steps"),
        default=5,
        metavar="N",
        help="1-200 (default 5)",
    )
    profile.add_argument(
        "--max-seconds",
        type=_bounded("profile", "max_seconds"),
        default=30.0,
        metavar="S",
        help="wall-clock cap on the profiled steps, 1-120 (default 30)",
    )
    profile.add_argument("--record-shapes", action="store_true", help="record input shapes")
    profile.add_argument("--profile-memory", action="store_true", help="record allocations")
    profile.add_argument("--with-stack", action="store_true", help="record Python stacks")
    profile.add_argument(
        "--sort",
        type=_sort_column,
        metavar="COLUMN",
        help="one of name, calls, self_cpu, cpu_total, self_device, device_total, cpu_memory, "
        "device_memory, share (default: device_total on device runs, else cpu_total)",
    )
    profile.add_argument("--rows", type=_positive_int, default=20, metavar="N", help="default 20")

    snapshot = _job_parser(
        sub,
        "snapshot",
        "CUDA allocator history over the next N steps: the snapshot file and top allocation "
        "sites (CUDA runs only)",
        "default 120",
        cmd_snapshot,
    )
    snapshot.add_argument(
        "--steps",
        type=_bounded("snapshot", "steps"),
        default=3,
        metavar="N",
        help="1-50 (default 3)",
    )
    snapshot.add_argument(
        "--max-entries",
        type=_bounded("snapshot", "max_entries"),
        default=100_000,
        metavar="N",
        help="allocator events kept, 1000-100000 (default 100000)",
    )
    snapshot.add_argument(
        "--rows", type=_positive_int, default=10, metavar="N", help="sites shown (default 10)"
    )

    nan_hunt = _job_parser(
        sub,
        "nan-hunt",
        "hooks on every module for up to N steps: the first module whose output or gradient "
        "is non-finite",
        "default 120",
        cmd_nan_hunt,
    )
    nan_hunt.add_argument(
        "--steps",
        type=_bounded("nan_hunt", "steps"),
        default=1,
        metavar="N",
        help="1-100 (default 1)",
    )

    anomaly = _job_parser(
        sub,
        "anomaly",
        "autograd anomaly detection for the next N steps (global and slow while on); backward "
        "errors are reported with the forward traceback",
        "default 120",
        cmd_anomaly,
    )
    anomaly.add_argument(
        "--steps",
        type=_bounded("anomaly", "steps"),
        default=10,
        metavar="N",
        help="1-50 (default 10)",
    )
    anomaly.add_argument(
        "--check-nan",
        action="store_true",
        help="also raise on NaN in backward (only where watch(anomaly_check_nan=True) allows it)",
    )

    activations = _job_parser(
        sub,
        "activations",
        "per-module output statistics every K steps, or off",
        "default 60",
        cmd_activations,
    )
    which = activations.add_mutually_exclusive_group()
    which.add_argument(
        "--every",
        type=_bounded("activations", "every"),
        default=10,
        metavar="K",
        help="sample every K steps, 1-10000 (default 10)",
    )
    which.add_argument("--off", action="store_true", help="turn activation statistics off")
    activations.add_argument(
        "--show", action="store_true", help="wait for the next sampled step and print it"
    )
    for p in (profile, snapshot, nan_hunt, anomaly):
        p.epilog = JOB_EPILOG
    activations.epilog = (
        "Exit status: 0 done; 2 bad arguments, no run, command refused, timeout, or the run "
        "ended first; 130 interrupted (statistics stay as set)."
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number > 0") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError("must be a number > 0")
    return value


def run(argv: Sequence[str], prog: str = "tdbg") -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, sys.stdout))
    except (CliError, ConnectError, ProtocolError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except JobFailed as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`tdbg dump | head`): not an error; silence the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


def tui_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tdbg-tui",
        description="Full-screen monitor of a PyTorch run. With no TARGET: attach to the only "
        "local run, pick among several, or wait for one to start.",
    )
    parser.add_argument("target", nargs="?", help="socket path, run .json or directory")
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return cmd_tui(args, sys.stdout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
