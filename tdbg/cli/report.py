"""Deep-dive results as text for the terminal: rich tables for profiles, snapshots, activations."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TextIO

from tdbg.cli.dump import unfinite
from tdbg.format import fmt, fmt_bytes, fmt_count, fmt_percent, fmt_seconds, fmt_stat, fmt_us
from tdbg.protocol.messages.results import (
    AnomalyResult,
    NanHuntResult,
    ProfileResult,
    SnapshotResult,
)


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


def _span(steps: tuple[int, int] | None) -> str:
    """A ``[first, last]`` pair of steps as ``first-last``."""
    return f"{steps[0]}-{steps[1]}" if steps else "?-?"


def _profile(result: Any) -> ProfileResult:
    """A profile as sent, or as read already; a malformed one reads as an empty profile."""
    if isinstance(result, ProfileResult):
        return result
    return ProfileResult.from_wire(result) or ProfileResult.of_ops([], device=False)


def profile_rows(result: Any, sort: str | None = None) -> list[dict[str, Any]]:
    """The result's rows (read as :class:`~tdbg.protocol.messages.results.ProfileRow`) with
    their ``share`` of the profiled time (fraction 0-1: :meth:`ProfileResult.share`, as the TUI
    shows it), sorted by ``sort`` (a row field or ``share``; default: the probe's own order).
    Numbers sort descending, names ascending."""
    profile = result if isinstance(result, ProfileResult) else ProfileResult.from_wire(result)
    if profile is None:
        return []
    rows = [dict(row.to_wire(), share=profile.share(row)) for row in profile.rows]
    if sort is None or sort == profile.sort:
        return rows
    if sort == "name":
        return sorted(rows, key=lambda r: str(r["name"]))
    return sorted(rows, key=lambda r: -(r.get(sort) or 0.0))


def print_profile(result: Any, out: TextIO, sort: str | None = None, limit: int = 20) -> None:
    """The top-ops table (device columns only on device runs), then the trace's path."""
    from rich.table import Table

    profile = _profile(result)
    device = profile.device
    rows = profile_rows(profile, sort)
    shown_sort = sort or profile.sort
    title = (
        f"profile of steps {_span(profile.steps)}, {fmt_seconds(profile.wall_seconds)}"
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
        cells = [str(row["name"]), fmt(row["calls"], "d")]
        cells += [fmt_us(row["self_cpu"]), fmt_us(row["cpu_total"])]
        if device:
            cells += [fmt_us(row["self_device"]), fmt_us(row["device_total"])]
        cells.append(fmt_bytes(row["cpu_memory"]))
        if device:
            cells.append(fmt_bytes(row["device_memory"]))
        cells.append(fmt_percent(row["share"]))
        table.add_row(*cells)
    notes = []
    if len(rows) > limit:
        notes.append(f"{len(rows) - limit} more ops (--rows)")
    if profile.truncated:
        notes.append("the probe sent its top 100 ops only")
    if not device:
        notes.append("CPU-only run: no device columns")
    if notes:
        table.caption = "; ".join(notes)
        table.caption_justify = "left"
    console = _console(out)
    console.print(table)
    trace = profile.trace
    if trace is not None:
        # soft_wrap: a path is never broken across lines (scripts and terminals pick it up).
        console.print(f"trace: {trace.path} ({fmt_bytes(trace.size)})", soft_wrap=True)
    else:
        console.print("trace: none written")


def print_snapshot(result: Any, out: TextIO, limit: int = 10) -> None:
    """The snapshot file and the top allocation sites by size."""
    from rich.table import Table

    snapshot = SnapshotResult.from_wire(result) or SnapshotResult((), None, None)
    console = _console(out)
    file = snapshot.file
    where = f"{file.path} ({fmt_bytes(file.size)})" if file else "none written"
    console.print(f"snapshot: {where}", soft_wrap=True)
    console.print(
        f"steps {_span(snapshot.steps)}: active {fmt_bytes(snapshot.active_bytes)}, "
        f"reserved {fmt_bytes(snapshot.reserved_bytes)}"
    )
    if snapshot.history_owner == "script":
        console.print("(the script records allocator history itself: left as it was)")
    top = snapshot.top
    if top:
        table = Table(title="top allocation sites", title_justify="left")
        table.add_column("bytes", justify="right", no_wrap=True)
        table.add_column("count", justify="right", no_wrap=True)
        table.add_column("site", overflow="fold")
        for site in top[:limit]:
            table.add_row(fmt_bytes(site.bytes), fmt(site.count, "d"), site.site)
        console.print(table)
    console.print("open it at https://pytorch.org/memory_viz")


def format_nan_hunt(result: Any) -> str:
    """What the hunt found, as lines of text."""
    hunt = NanHuntResult.from_wire(result) or NanHuntResult()
    checked = hunt.steps_checked
    if not hunt.found:
        return f"no non-finite value in {checked} step{'s' if checked != 1 else ''}\n"
    module = hunt.module
    name = "the root model" if module == "" else str(module)
    lines = [
        f"first non-finite {hunt.phase} value: {name} ({hunt.module_type}) at step {hunt.step}",
        f"  non-finite elements:    {fmt(hunt.nonfinite, 'd')} of {fmt(hunt.numel, 'd')}",
        f"  input min / max:        {fmt_stat(hunt.input_min)} / {fmt_stat(hunt.input_max)}",
        f"  inputs already non-finite: {'yes' if hunt.input_nonfinite else 'no'}",
        f"  non-finite parameters:  {fmt(hunt.params_nonfinite, 'd')}",
        *(
            [
                "  (its weights were already non-finite: an earlier optimizer step spread the NaN;"
                " the first nonfinite_grad alert names the layer where it began)"
            ]
            if hunt.params_nonfinite
            else []
        ),
        f"  steps checked: {checked} ({hunt.trigger})",
    ]
    return "\n".join(lines) + "\n"


def format_anomaly(result: Any, alerts: Sequence[dict[str, Any]]) -> str:
    """Anomaly mode's summary, then every backward error's forward traceback."""
    anomaly = AnomalyResult.from_wire(result) or AnomalyResult(None, False, None)
    errors = anomaly.errors or 0
    lines = [
        f"anomaly mode done: {anomaly.steps} steps, check_nan "
        f"{'on' if anomaly.check_nan else 'off'}, "
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
            *(fmt_stat(unfinite(row.get(k))) for k in ("mean", "std", "min", "max")),
            fmt_percent(unfinite(zero)),
            fmt(row.get("nonfinite"), "d"),
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
        done = msg.get("done")
        if total is None:  # activation statistics run until turned off
            text = f"running {fmt_count(done, 'step')}"
        else:
            text = f"running {done}/{total}"
        if msg.get("step") is not None:
            text += f" (step {msg.get('step')})"
    else:
        text = str(state)
    if msg.get("message") and state not in ("armed", "running", "done"):
        # armed repeats the ack's note and running its k/N; analysing and the end say more.
        text += f": {msg['message']}"
    return f"{head}: {text}"
