"""``tdbg report TARGET``: a run's (or a job's) diagnosis after the fact — verdicts first, evidence
after, readable in 30 seconds; ``--json`` for scripts, ``--html FILE`` for a bug report."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tdbg.cli.errors import CliError
from tdbg.cli.glance import add_history_timeout, read_state, the_only_run
from tdbg.cli.job_targets import (
    add_job_option,
    job_by_name,
    job_entries_for,
    rank_of,
    say_rank_failed,
)
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, target_arg
from tdbg.connect.client import ConnectError
from tdbg.format import fmt_pct, fmt_us, spark_bars
from tdbg.protocol.framing import ProtocolError

if TYPE_CHECKING:
    from tdbg.model.diagnosis import Diagnosis, JobDiagnosis

MARKS = {"bad": "✗", "warn": "!", "ok": "✓"}
WORDS = {"bad": "TROUBLE", "warn": "WARNINGS", "ok": "OK"}


def add_report_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "report",
        help="a run's diagnosis: verdicts first (NaN, stalls, spikes, input-bound), then evidence",
        description=(
            "What a run did, in short: its verdicts first (where a NaN began, stalls, loss "
            "spikes, exploding or missing gradients, clipping, input-bound time), then the "
            "evidence (loss, speed, where the time went, probe cost, memory, top ops of the last "
            "profile) with small charts. TARGET: a live run, a recording, or several ranks' "
            "recordings of one job (or a directory of them: a job, judged as its screen "
            "judges it). Exit status: 0 reported; 2 no run, not a recording, bad arguments."
        ),
    )
    p.add_argument("targets", nargs="*", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    add_job_option(p, "the report")
    p.add_argument("--json", action="store_true", help="the diagnosis as one JSON object")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write the report as one self-contained HTML page (charts inline, no network)",
    )
    add_history_timeout(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    from tdbg.model.diagnosis import diagnose, diagnose_job

    report: Diagnosis | JobDiagnosis
    args.targets = job_by_name(args, list(args.targets))  # a name one job's ranks share: --job
    recordings = _job_recordings(list(args.targets), args.job)
    if recordings:
        from tdbg.model.recordings import load_job
        from tdbg.recording.reader import RecordingError

        try:
            job, alerts = load_job(recordings)
        except RecordingError as exc:
            raise CliError(str(exc)) from None
        report = diagnose_job(job, alerts)
    elif args.job is not None:
        report = _live_job(args)
    else:
        if len(args.targets) > 1:
            raise CliError("report takes one run (or the recordings of one job's ranks)")
        text = args.targets[0] if args.targets else the_only_run()
        report = diagnose(read_state(text, args))
    if args.html:
        from tdbg.cli.report_html import write_html

        write_html(report, Path(args.html))
    if args.json:
        out.write(json.dumps(report.to_json()) + "\n")
    else:
        text = render_text(report)
        out.write(colour(text) if _wants_colour(out) else text)
    out.flush()
    return 0


def _job_recordings(targets: list[str], job: str | None) -> list[Path]:
    """The recordings of one job's ranks the arguments name: a directory (or ``--job DIR``),
    or several files; [] for one run or a live job."""
    from tdbg.recording.reader import is_recording

    named = [Path(t) for t in ([job] if job is not None else []) + targets]
    if any(p.is_dir() for p in named):
        if len(named) > 1:
            raise CliError("report takes one directory of a job's recordings, alone")
        found = sorted(p for p in named[0].iterdir() if p.is_file() and is_recording(p))
        if not found:
            raise CliError(f"{named[0]}: no tdbg recordings in that directory")
        return found
    if len(named) > 1 and all(p.is_file() and is_recording(p) for p in named):
        return named
    return []


def _live_job(args: argparse.Namespace) -> JobDiagnosis:
    """A live job's ranks read at a glance and judged now."""
    from tdbg.model.diagnosis import diagnose_job
    from tdbg.model.job import Job
    from tdbg.model.job_alerts import JobAlerts

    ranks = {str(e.socket): rank_of(e) for e in job_entries_for(args, list(args.targets))}
    states = {}
    for text, rank in ranks.items():
        try:
            states[rank] = read_state(text, args)
        except (CliError, ConnectError, ProtocolError, OSError) as exc:
            say_rank_failed(rank, str(exc) or type(exc).__name__)
    if not states:
        raise CliError(f"no rank of job {args.job} could be reached")
    job = Job(str(args.job), dict(sorted(states.items())))
    alerts = JobAlerts()
    alerts.update(job)
    return diagnose_job(job, alerts)


# --- text -------------------------------------------------------------------------------------


def render_text(report: Diagnosis | JobDiagnosis) -> str:
    from tdbg.model.diagnosis import Diagnosis

    if isinstance(report, Diagnosis):
        return _run_text(report)
    lines = [
        f"tdbg report · job {report.job} · {len(report.ranks)} of {report.world_size} ranks"
        f" · {WORDS[report.level]}",
        "",
        "job findings",
    ]
    if not report.findings:
        lines.append("  ✓ no straggler, no diverged rank, no NaN on some ranks only, no hang")
    for finding in report.findings:
        lines.append(f"  {MARKS.get(finding.level, '?')} {finding.headline}")
        lines.extend(f"      {e}" for e in finding.evidence)
    for rank, diagnosis in report.ranks.items():
        lines.append("")
        lines.append(f"rank {rank}")
        lines.extend(("  " + line).rstrip() for line in _run_text(diagnosis).splitlines())
    return "\n".join(lines) + "\n"


def _run_text(d: Diagnosis) -> str:
    from tdbg.model.diagnosis import figure_lines

    pid = d.run.get("pid")
    head = f"tdbg report · {d.name}" + (f" (pid {pid})" if pid else "")
    lines = [f"{head} · {d.health.word}: {d.health.detail} · {WORDS[d.level]}", "", "verdicts"]
    columns = max(60, shutil.get_terminal_size((100, 24)).columns - 1)
    for verdict in d.verdicts:
        lines.append(f"  {MARKS.get(verdict.level, '?')} {verdict.headline}")
        for evidence in verdict.evidence:  # wrapped under itself, not under the margin
            lines.extend(
                textwrap.wrap(
                    evidence,
                    columns,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 8,
                    break_on_hyphens=False,
                )
            )
    lines += ["", "evidence"]
    figures = figure_lines(d)
    if d.loss_chart:
        figures.insert(2, ("loss chart", spark(d.loss_chart)))
    if d.grad_chart:
        figures.insert(3, ("grad norm", spark(d.grad_chart)))
    for i, op in enumerate(d.top_ops):
        share = fmt_pct(op["share"]) if op["share"] is not None else "n/a"
        label = "top ops (last profile)" if i == 0 else ""
        figures.append((label, f"{share:>6}  {fmt_us(op['self_us']):>9}  {op['name']}"))
    width = max(len(label) for label, _ in figures)
    for label, value in figures:
        lines.extend(
            textwrap.wrap(
                f"  {label:<{width}}  {value}", columns, subsequent_indent=" " * (width + 4)
            )
            or [""]
        )
    return "\n".join(lines) + "\n"


COLOURS = {"✗": "31", "!": "33", "✓": "32", "TROUBLE": "1;31", "WARNINGS": "1;33", "OK": "1;32"}


def _wants_colour(out: TextIO) -> bool:
    """Colour on a terminal, as most CLIs: never when piped, nor with NO_COLOR set."""
    isatty = getattr(out, "isatty", lambda: False)()
    return bool(isatty) and not os.environ.get("NO_COLOR")


def colour(text: str) -> str:
    """The verdict marks and the headline word in their colours (ANSI SGR)."""
    lines = []
    for line in text.splitlines():
        stripped = line.lstrip()
        mark = stripped[:1]
        if mark in ("✗", "!", "✓") and stripped[1:2] == " ":
            line = line.replace(mark, f"\x1b[{COLOURS[mark]}m{mark}", 1) + "\x1b[0m"
        elif line.startswith(("tdbg report", "  tdbg report")):
            for word in ("TROUBLE", "WARNINGS", "OK"):
                if line.endswith(word):
                    line = line[: -len(word)] + f"\x1b[{COLOURS[word]}m{word}\x1b[0m"
            line = f"\x1b[1m{line}"
        elif stripped in ("verdicts", "evidence", "job findings") or stripped.startswith("rank "):
            line = f"\x1b[1m{line}\x1b[0m"
        lines.append(line)
    return "\n".join(lines) + "\n"


def spark(values: list[float]) -> str:
    """A sparkline of ``values`` (format.spark_bars), first and last value beside it."""
    (bars,), log = spark_bars([values])
    first = next((v for v in values if math.isfinite(v)), None)
    if first is None:
        return bars
    return f"{bars}  {first:.4g} → {values[-1]:.4g}" + (" (log)" if log else "")
