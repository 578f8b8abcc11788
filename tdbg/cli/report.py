"""Deep-dive results as text for the terminal: rich tables for profiles, snapshots, activations."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, TextIO

from tdbg.cli.dump import finite


def _format_us(us: Any) -> str:
    """Microseconds as a short human figure: 812 us, 3.41 ms, 1.20 s."""
    if not isinstance(us, int | float) or isinstance(us, bool):
        return "n/a"
    if not math.isfinite(us):
        return str(finite(float(us)))
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
        return f"{v:.4g}" if math.isfinite(v) else str(finite(v))
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
    if result.get("history_owner") == "script":
        console.print("(the script records allocator history itself: left as it was)")
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
        *(
            [
                "  (its weights were already non-finite: an earlier optimizer step spread the NaN;"
                " the first nonfinite_grad alert names the layer where it began)"
            ]
            if result.get("params_nonfinite")
            else []
        ),
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
