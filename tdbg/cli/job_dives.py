"""A deep dive on every rank of a job (``tdbg profile --job JOB [--ranks 0,2]``): one client per
rank, all at once, each with the one-run machinery; results by rank, a failed rank one line."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from tdbg.cli.dives import (
    CANCEL_TIMEOUT,
    JobFailed,
    JobWatch,
    _progress,
    _write_json,
    dive_request,
    follow_activations,
    follow_job,
    print_activations_outcome,
)
from tdbg.cli.errors import CliError
from tdbg.cli.job_targets import say_rank_failed
from tdbg.cli.report import format_anomaly, format_nan_hunt, print_profile, print_snapshot
from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.jobs import job_ranks
from tdbg.connect.runtime import RunEntry, discover
from tdbg.protocol.framing import ProtocolError
from tdbg.protocol.messages.results import AnomalyResult, NanHuntResult

JOIN_POLL = 0.2  # seconds: the main thread wakes this often, so Ctrl-C is taken at once
CANCEL_GRACE = CANCEL_TIMEOUT + 5.0  # seconds the ranks get to cancel their jobs after Ctrl-C


def rank_list(text: str) -> list[int]:
    """argparse type of ``--ranks``: ``0,2`` or ``0-3,6``, ranks >= 0."""
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError
            ranks.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: ranks are numbers >= 0, as 0,2 or 0-3"
        ) from None
    return sorted(ranks)


@dataclass
class RankOutcome:
    """One rank's dive: its result, or why there is none."""

    rank: int
    result: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False  # set last by the rank's thread: result or error is final


def _dive(
    args: argparse.Namespace, entry: RunEntry, outcome: RankOutcome, stop: threading.Event
) -> None:
    """The dive on one rank, on a thread of its own (fills ``outcome``)."""
    prefix = f"rank {outcome.rank}: "
    show = _progress(args)
    progress = None if show is None else (lambda line: show(prefix + line))
    client: ProbeClient | None = None
    try:
        client = ProbeClient.connect(entry.socket)
        if args.command == "activations":
            watch = JobWatch(client, "activations", args.timeout or 60.0, progress)
            outcome.result = follow_activations(watch, args, stop.is_set, prefix)
        else:
            command, timeout, cmd_args = dive_request(args)
            watch = JobWatch(client, command, timeout, progress)
            outcome.result = follow_job(watch, stop.is_set, prefix, **cmd_args)
        if outcome.result is None:  # Ctrl-C: cancel this rank's job
            cancelled = watch.cancel_on_abort and watch.cancel()
            outcome.error = (
                f"interrupted ({watch.command} job cancelled)" if cancelled else ("interrupted")
            )
    except (CliError, ConnectError, ProtocolError, JobFailed, OSError) as exc:
        outcome.error = str(exc) or type(exc).__name__
    finally:
        if client is not None:
            client.close()
        outcome.done = True


def run_on_ranks(args: argparse.Namespace) -> list[RankOutcome]:
    """Start the dive on every chosen rank of ``args.job`` at once and wait for all of them.
    Ctrl-C cancels it on every rank, then re-raises."""
    if args.target is not None:
        raise CliError("--job names the runs: give no TARGET with it")
    running = job_ranks(args.job, discover())
    # Every rank of the job by default, so one that has ended (or not started) is named too.
    world = max(int(e.meta.get("world_size") or 0) for e in running.values())
    chosen = args.ranks if args.ranks is not None else sorted(set(range(world)) | set(running))
    outcomes = [RankOutcome(rank) for rank in chosen]
    stop = threading.Event()
    started = []
    for outcome in outcomes:
        entry = running.get(outcome.rank)
        if entry is None:
            outcome.error = (
                f"not running: no such rank of job {args.job} serves here (it ended, or has not"
                f" started; ranks serving: {', '.join(map(str, running))})"
            )
            outcome.done = True
            continue
        thread = threading.Thread(
            target=_dive, args=(args, entry, outcome, stop), name=f"rank-{outcome.rank}"
        )
        thread.daemon = True  # a rank that never answers must not keep tdbg alive
        thread.start()
        started.append(outcome)
    # The main thread sleeps and looks rather than joining: a Ctrl-C that interrupts
    # Thread.join() can leave that thread looking finished to the next join (CPython 3.11),
    # and the ranks' cancels were then cut short.
    try:
        while not all(o.done for o in started):
            time.sleep(JOIN_POLL)
    except KeyboardInterrupt:
        stop.set()
        deadline = time.monotonic() + CANCEL_GRACE
        while not all(o.done for o in started) and time.monotonic() < deadline:
            time.sleep(JOIN_POLL / 4)
        cancelled = [o.rank for o in outcomes if o.done and "cancelled" in (o.error or "")]
        if cancelled:
            print(f"tdbg: interrupted: cancelled on ranks {cancelled}", file=sys.stderr)
        for o in outcomes:  # the others: why not (finished, refused, no answer in time)
            if o.rank not in cancelled:
                why = (o.error or "finished") if o.done else "no answer in time"
                print(f"tdbg: rank {o.rank}: not cancelled: {why}", file=sys.stderr)
        raise
    return outcomes


def cmd_job_dive(args: argparse.Namespace, out: TextIO) -> int:
    """The dive on every chosen rank; exit 0 when one rank answered or more, else 2."""
    if args.ranks is not None and args.job is None:
        raise CliError("--ranks chooses ranks of a job: give --job JOB too")
    outcomes = run_on_ranks(args)
    answered = [o for o in outcomes if o.result is not None]
    failed = [o for o in outcomes if o.result is None]
    for outcome in failed:
        say_rank_failed(outcome.rank, outcome.error or "no result")
    if args.json:
        _write_json(out, job_json(args, outcomes))
    elif args.command == "profile":
        from tdbg.cli.job_report import print_job_profile

        print_job_profile(args.job, {o.rank: o.result for o in answered}, out, args.sort, args.rows)
    else:
        for outcome in sorted(answered, key=lambda o: (not _found(args.command, o), o.rank)):
            out.write(f"--- rank {outcome.rank}\n")
            _print_one(args, outcome.result or {}, out)
    out.flush()
    if not answered:
        raise CliError(f"no rank of job {args.job} answered")
    return 0


def job_json(args: argparse.Namespace, outcomes: list[RankOutcome]) -> dict[str, Any]:
    """The job's dive as one JSON object: every rank's result (or error), each with its rank;
    for a profile, the slowest and fastest rank too."""
    ranks = [
        dict(o.result, rank=o.rank) if o.result is not None else {"rank": o.rank, "error": o.error}
        for o in outcomes
    ]
    value: dict[str, Any] = {"job": args.job, "command": args.command, "ranks": ranks}
    if args.command == "profile":
        from tdbg.model.rank_profiles import compare_profiles

        results = {o.rank: o.result for o in outcomes if o.result is not None}
        comparison = compare_profiles(results)
        if comparison is not None:
            value["slowest"] = comparison.slowest.rank
            value["fastest"] = comparison.fastest.rank
    return value


def _found(command: str, outcome: RankOutcome) -> bool:
    """Whether a rank's result holds a finding (it is shown first)."""
    result = outcome.result or {}
    if command == "nan-hunt":
        hunt = NanHuntResult.from_wire(result)
        return hunt is not None and hunt.found
    if command == "anomaly":
        anomaly = AnomalyResult.from_wire(result)
        return anomaly is not None and bool(anomaly.errors)
    if command == "activations":
        layers = result.get("layers") or {}
        return any((row or {}).get("nonfinite") for row in layers.values())
    return False


def _print_one(args: argparse.Namespace, result: dict[str, Any], out: TextIO) -> None:
    if args.command == "nan-hunt":
        out.write(format_nan_hunt(result))
    elif args.command == "anomaly":
        out.write(format_anomaly(result, result.get("alerts") or []))
    elif args.command == "snapshot":
        print_snapshot(result, out, args.rows)
    elif args.command == "activations":
        print_activations_outcome(result, out)
    else:
        print_profile(result, out, args.sort, args.rows)
