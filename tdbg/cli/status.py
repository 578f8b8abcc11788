"""``tdbg status [TARGET...]``: one line per run (step, loss, steps/s, health) for ssh and cron."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any, TextIO

from tdbg.cli.args import positive_float
from tdbg.cli.errors import CliError
from tdbg.cli.glance import SYNC_SECONDS, read_state
from tdbg.cli.job_targets import (
    add_job_option,
    job_by_name,
    job_entries_for,
    rank_of,
    say_rank_failed,
)
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, target_arg
from tdbg.connect.client import ConnectError
from tdbg.connect.runtime import discover, runtime_dir
from tdbg.format import fmt, fmt_count, fmt_loss, fmt_rate
from tdbg.protocol.framing import ProtocolError

if TYPE_CHECKING:
    from tdbg.model.health import Health
    from tdbg.model.run_state import RunState

EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


def add_status_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "status",
        help="one line per run: step, loss, steps/s and health; exit 1 if any is unhealthy",
        description=(
            "One line per run: its name, step, loss, steps/s, a health verdict (live, stalled, "
            "non-finite, input-bound, ended, probe off) and its alert count. Without TARGET, "
            "every run on this machine. Exit status: 0 no trouble (a run that ended cleanly, and "
            "warnings such as input-bound or a straggler, count as no trouble unless --strict), "
            "1 trouble: stalled, non-finite, dead (exited with an error, killed), probe off, "
            "diverged or hung ranks (with --job: or a rank that cannot be reached, named on "
            "stderr), 2 no run (no rank reached) or bad arguments."
        ),
    )
    p.add_argument("targets", nargs="*", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 on warnings too (input-bound, a straggler), not only on trouble",
    )
    add_job_option(p, "the lines")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=SYNC_SECONDS,
        metavar="S",
        help=f"wait at most S seconds for a run's history (default {SYNC_SECONDS:g})",
    )
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    from tdbg.model.health import assess  # numpy: loaded by this command only

    texts = job_by_name(args, list(args.targets))  # a name one job's ranks share: as --job
    ranks: dict[str, int] = {}  # under --job: each socket's rank, to name one that gives nothing
    if args.job is not None:
        ranks = {str(e.socket): rank_of(e) for e in job_entries_for(args, texts)}
        texts = list(ranks)
    if not texts:
        entries = discover()
        if not entries:
            raise CliError(f"no tdbg runs in {runtime_dir()}")
        texts = [str(e.socket) for e in entries]
    from tdbg.model.job import Job
    from tdbg.model.job_alerts import finding_level
    from tdbg.model.straggler_history import StragglerHistory

    worst = 0
    states = []
    for text in texts:
        try:
            states.append(read_state(text, args))
        except (CliError, ConnectError, ProtocolError, OSError) as exc:
            why = str(exc) or type(exc).__name__
            if text in ranks:  # a rank of the job: named, the job's line counts it missing
                say_rank_failed(ranks[text], why)
                worst = max(worst, EXIT_UNHEALTHY)
            else:
                print(f"tdbg: error: {why}", file=sys.stderr, flush=True)
                worst = max(worst, EXIT_USAGE)
    if ranks and not states:
        raise CliError(f"no rank of job {args.job} could be reached")
    jobs, single = Job.group(states)
    for state in single:
        health = assess(state)
        out.write(_line(state, health, args.json))
        if _fails(health.level, args.strict):
            worst = max(worst, EXIT_UNHEALTHY)
    for job in jobs:
        # A distributed job: its ranks (compared with each other here, outside the job),
        # then what the comparison found.
        findings = job.findings()
        missing = job.missing_ranks()
        # Which rank was the slowest over the ranks' recent history, not only in the latest
        # window: a straggler that comes and goes.
        history = StragglerHistory()
        history.update(job)
        if args.json:
            out.write(
                json.dumps(
                    {
                        "job": job.job,
                        "world_size": job.world_size,
                        "missing_ranks": missing,
                        "findings": [
                            {
                                "kind": f.kind,
                                "ranks": f.ranks,
                                "message": f.message,
                                "level": finding_level(f.kind),
                            }
                            for f in findings
                        ],
                        "slowest": history.to_json(),
                    }
                )
                + "\n"
            )
        else:
            shown = f"{len(job.ranks)} of {job.world_size} ranks"
            out.write(f"job {job.job[:12]}  {shown}" + (f", missing {missing}" if missing else ""))
            out.write("\n")
        for state in job.ranks.values():
            health = assess(state)
            out.write(_line(state, health, args.json, prefix="  "))
            if _fails(health.level, args.strict):
                worst = max(worst, EXIT_UNHEALTHY)
        if not args.json:
            for finding in findings:
                out.write(f"  {finding.kind}: {finding.message}\n")
            out.write(f"  slowest over time: {history.line()}\n")
        if any(_fails(finding_level(f.kind), args.strict) for f in findings):
            worst = max(worst, EXIT_UNHEALTHY)
    out.flush()
    return worst


def _fails(level: str, strict: bool) -> bool:
    """Whether a verdict of ``level`` makes the exit status 1: trouble always, a warning only
    with --strict."""
    return level == "bad" or (strict and level == "warn")


def _line(state: RunState, health: Health, as_json: bool, prefix: str = "") -> str:
    name = str(state.run.get("name") or "?")
    rank = state.run.get("rank")
    if isinstance(state.run.get("world_size"), int) and rank is not None:
        name = f"{name}[{rank}]"
    step = state.last_step
    loss = state.last_loss
    if as_json:
        rate = health.steps_per_sec
        return (
            json.dumps(
                {
                    "name": name,
                    "pid": state.run.get("pid"),
                    "rank": state.run.get("rank"),
                    "job": state.run.get("job"),
                    "step": step,
                    "loss": loss if loss is None or math.isfinite(loss) else str(loss),
                    "steps_per_sec": rate,
                    "health": health.word,
                    "level": health.level,
                    "detail": health.detail,
                    "alerts": state.alert_count,
                }
            )
            + "\n"
        )
    rate = health.steps_per_sec
    parts = [
        f"{name:<20}",
        f"step {fmt(step, 'd'):>7}",
        f"loss {fmt_loss(loss):>9}",
        f"{fmt_rate(rate):>6} steps/s",
        f"{health.word:<11}",
        fmt_count(state.alert_count, "alert"),
    ]
    detail = "" if health.word == "live" else f"  ({health.detail})"
    return prefix + "  ".join(parts) + detail + "\n"
