"""``tdbg compare A B [C ...]``: runs side by side — recordings, live runs or both — which is ahead,
where their losses part, the layers that differ most and how they were started differently."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import textwrap
from typing import TYPE_CHECKING, Any, TextIO

from tdbg.cli.errors import CliError
from tdbg.cli.glance import add_history_timeout, read_state
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, target_arg
from tdbg.connect.client import ConnectError
from tdbg.format import fmt, fmt_loss, fmt_pct, fmt_seconds, fmt_span, spark_bars
from tdbg.protocol.framing import ProtocolError

if TYPE_CHECKING:
    from tdbg.model.comparison import Comparison
    from tdbg.model.overlays import Overlay


# The run's own series as a person reads them (the JSON keeps the short names).
LABELS = {"step_time": "step time (s)", "grad_norm": "gradient norm (total)"}


def add_compare_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "compare",
        help="runs side by side: which is ahead, where their losses part, what differs",
        description=(
            "Two or more runs side by side (recordings, live runs, or both): final and best "
            "loss, speed and where the time went, logged metrics; which run is ahead at the end "
            "of the steps they share and by how much; the first step where the first two runs' "
            "smoothed losses part beyond their noise; the layers whose gradient norms differ "
            "most; what differs in how they were started (command line, torch, device, "
            "optimizers, learning rate); the loss, learning rate, step time, gradient norm and "
            "every logged metric overlaid, one small chart each. Runs that share no steps are "
            "compared by the time since each started (--by time asks for it). "
            "Exit status: 0 compared; 2 a run cannot be read, bad arguments."
        ),
    )
    p.add_argument("targets", nargs="+", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    p.add_argument("--json", action="store_true", help="the comparison as one JSON object")
    p.add_argument(
        "--by",
        choices=("step", "time"),
        help="overlay the runs by step, or by the time since each started (default: by step, "
        "or by time when the runs share no step)",
    )
    add_history_timeout(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace, out: TextIO) -> int:
    from tdbg.model.comparison import compare

    if len(args.targets) < 2:
        raise CliError("compare needs two runs or more (recordings or live runs)")
    states = []
    for text in args.targets:
        try:
            states.append(read_state(text, args))
        except (ConnectError, ProtocolError, OSError) as exc:
            raise CliError(f"{text}: {exc}") from None
    empty = [t for t, s in zip(args.targets, states, strict=True) if not s.n_steps]
    if empty:
        raise CliError(f"{empty[0]}: no steps to compare")
    result = compare(states, list(args.targets), args.by)
    out.write(json.dumps(result.to_json()) + "\n" if args.json else render(result))
    out.flush()
    return 0


def render(c: Comparison) -> str:
    letters = [chr(ord("A") + i) for i in range(len(c.runs))]
    unit = "step" if c.axis == "step" else "s"
    if c.common is None:
        shared = "nothing shared"
    elif c.axis == "step":
        shared = f"shared steps {fmt(c.common[0], '.6g')}–{fmt(c.common[1], '.6g')}"
    else:
        shared = f"shared seconds {fmt(c.common[0], '.3g')}–{fmt(c.common[1], '.3g')}"
    lines = [f"tdbg compare · {len(c.runs)} runs by {c.axis} ({shared})", ""]
    for letter, run in zip(letters, c.runs, strict=True):
        lines.append(f"  {letter}  {run.name}  {run.source}")
    lines.append("")
    lines += _verdicts(c, letters, unit)
    rows: list[tuple[str, list[str]]] = [
        ("steps", [f"{r.steps} (last {r.last_step})" for r in c.runs]),
        ("loss, smoothed at end", [fmt_loss(r.loss_final) for r in c.runs]),
        (
            "best loss",
            [
                f"{fmt_loss(r.loss_best)} @ {r.loss_best_step}"
                if r.loss_best is not None
                else "n/a"
                for r in c.runs
            ],
        ),
        ("steps/s", [fmt(r.steps_per_sec) for r in c.runs]),
        ("step time (median)", [fmt_seconds(r.step_time) for r in c.runs]),
    ]
    for phase in c.runs[0].phases:
        if any(r.phases.get(phase) for r in c.runs):
            label = phase.removesuffix("_time").replace("_", "-") + " share"
            rows.append((label, [fmt_pct(r.phases.get(phase)) for r in c.runs]))
    for name in sorted({m for r in c.runs for m in r.metrics_final}):
        rows.append((name, [fmt(r.metrics_final.get(name), ".4g") for r in c.runs]))
    width = max(len(label) for label, _ in rows)
    col = max(12, *(len(v) for _, values in rows for v in values))
    lines.append("  " + " " * width + "  " + "".join(f"{x:<{col + 2}}" for x in letters))
    for label, values in rows:
        lines.append(f"  {label:<{width}}  " + "".join(f"{v:<{col + 2}}" for v in values))
    if c.charts:
        lines.append("")
        over = "steps" if c.axis == "step" else "seconds since each started"
        lines.append(f"  loss, smoothed, over the shared {over} (one scale per chart)")
        for letter, bars in zip(letters, overlay(c.charts), strict=True):
            lines.append(f"  {letter} {bars}")
    for series in c.overlays:
        lines.append("")
        lines += _overlaid(series, letters, c.axis)
    if c.only_in:
        lines.append("")
        groups: dict[tuple[int, ...], list[str]] = {}
        for name, runs in c.only_in.items():
            groups.setdefault(tuple(runs), []).append(LABELS.get(name, name))
        for having, names in sorted(groups.items()):
            who = ", ".join(letters[i] for i in having)
            lines += textwrap.wrap(
                f"only in {who}: " + ", ".join(names),
                _columns(),
                initial_indent="  ",
                subsequent_indent="    ",
            )
    if c.started:
        lines.append("")
        lines.append("  started differently")
        for key, values in c.started.items():
            for letter, value in zip(letters, values, strict=True):
                lines.append(f"    {key:<10} {letter}: {value}")
    for note in c.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines).rstrip() + "\n"


def _verdicts(c: Comparison, letters: list[str], unit: str) -> list[str]:
    out = []
    if c.ahead is not None and c.common is not None:
        at = f"at {unit} {fmt(c.common[1], '.6g')}"
        by = f" by {c.ahead_by:.4g}" if c.ahead_by is not None else ""
        out.append(f"  {letters[c.ahead]} is ahead{by} (smoothed loss {at})")
    if c.parted_at is not None:
        out.append(
            f"  {letters[0]} and {letters[1]} part at {unit} {fmt(c.parted_at, '.6g')} "
            "(their smoothed losses differ beyond their noise from there on)"
        )
    elif c.common is not None:
        out.append(f"  {letters[0]} and {letters[1]} stay within their noise of each other")
    if c.layers:
        parts = [
            f"{name} {format(10 ** abs(ratio), ',.0f' if abs(ratio) >= 2 else '.3g')}× "
            + ("larger" if ratio > 0 else "smaller")
            for name, ratio in c.layers
        ]
        out.append(f"  gradient norms differ most, in {letters[1]}: " + ", ".join(parts))
    columns = _columns()
    wrapped = [w for line in out for w in textwrap.wrap(line, columns, subsequent_indent="    ")]
    return [*wrapped, ""] if wrapped else []


def _columns() -> int:
    return max(60, shutil.get_terminal_size((100, 24)).columns - 1)


def _overlaid(chart: Overlay, letters: list[str], axis: str) -> list[str]:
    """One series of the runs that have it as sparklines on one scale, under a line naming it
    and the stretch it covers."""
    lo, hi = chart.span
    if axis == "step":
        span = f"steps {lo:.0f}–{hi:.0f}"
    elif hi < 60:  # a short run: whole seconds would read 0s–1s
        span = f"{lo:.3g}–{hi:.3g} s since each started"
    else:
        span = f"{fmt_span(lo)}–{fmt_span(hi)} since each started"
    lines = [f"  {LABELS.get(chart.name, chart.name)} · {span}"]
    shown = [s for s in chart.series if s is not None]
    bars = iter(spark_bars(shown)[0])
    for letter, series, last in zip(letters, chart.series, chart.last, strict=True):
        if series is None:
            lines.append(f"  {letter} (none)")
            continue
        end = f"  {last:.4g}" if last is not None and math.isfinite(last) else ""
        lines.append(f"  {letter} {next(bars)}{end}")
    return lines


def overlay(charts: list[list[float]]) -> list[str]:
    """Sparklines of several series on one scale (format.spark_bars), each with its last value,
    so heights compare across runs."""
    bars, _ = spark_bars(charts)
    return [
        line + (f"  {chart[-1]:.4g}" if chart and math.isfinite(chart[-1]) else "")
        for line, chart in zip(bars, charts, strict=True)
    ]
