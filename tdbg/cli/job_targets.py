"""``--job JOB`` for ``tdbg dump``, ``tdbg status`` and ``tdbg ls``: a job's local ranks as the
targets, each event and line carrying its rank; a TARGET that is the name the ranks share too."""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from tdbg.cli.dump import Window, dump_events, windowed
from tdbg.cli.errors import CliError
from tdbg.cli.target_args import attach_target
from tdbg.connect.client import ConnectError
from tdbg.connect.jobs import job_ranks
from tdbg.connect.runtime import RunEntry, discover
from tdbg.connect.targets import Job, resolve
from tdbg.connect.waiting import next_item
from tdbg.protocol.framing import ProtocolError

# A rank's reader thread hands its events over in order; None says that rank is done.
RankEvents = queue.Queue[dict[str, Any] | None]


def add_job_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--job",
        metavar="JOB",
        help=f"{what} of every local rank of distributed job JOB (its id: `tdbg status` and "
        "`tdbg ls --json` show it); give no TARGET with it",
    )


def named_job(text: str | None) -> str | None:
    """The job that TARGET ``text`` names when it is the name the job's ranks share (``tdbg dump
    NAME`` then means the job, as ``--job JOB``); None for any other TARGET, a mistake included
    (the command's own resolving words it)."""
    if text is None:
        return None
    try:
        target = resolve(text)
    except ConnectError:
        return None
    return target.job if isinstance(target, Job) else None


def job_by_name(args: argparse.Namespace, texts: list[str]) -> list[str]:
    """The TARGETs left once a shared name is taken as its job: when ``texts`` is one name that
    the ranks of one job share and ``--job`` is not given, ``args.job`` becomes that job and no
    TARGET is left; otherwise ``texts`` as they are."""
    if args.job is None and len(texts) == 1:
        job = named_job(texts[0])
        if job is not None:
            args.job = job
            return []
    return texts


def job_entries_for(args: argparse.Namespace, targets: list[Any]) -> list[RunEntry]:
    """The live ranks of ``args.job``, rank order; one line (exit 2) when it has none here or a
    TARGET was given too."""
    if targets:
        raise CliError("--job names the runs: give no TARGET with it")
    return list(job_ranks(args.job, discover()).values())


def say_rank_failed(rank: object, reason: str) -> None:
    """The one stderr line for a rank of a job that gave nothing (``--job`` on any command)."""
    print(f"tdbg: error: rank {rank}: {reason}", file=sys.stderr, flush=True)


def rank_of(entry: RunEntry) -> int:
    """A job's rank's number, as its metadata says."""
    return int(entry.meta.get("rank") or 0)


JUDGE_SECONDS = 0.25  # the job is judged at most this often (as the job screen repaints)


def dump_job(args: argparse.Namespace, out: TextIO) -> int:
    """Every reachable rank's events (each with its ``rank``), interleaved as they arrive, the
    window (``--last``, ``--count``, ``--follow``) applied per rank; done when every rank is.
    The job is judged as its screen judges it (stragglers, diverged ranks, NaN on some ranks,
    hangs: tdbg.model.job_alerts) and each finding raised or cleared is a ``job_alert`` event.
    A rank that cannot be reached is one line on stderr and the others are still dumped (as
    ``profile --job`` does); exit 2 only when no rank could be reached."""
    window = Window.of(args.follow, args.last, args.count)
    for event in job_events(args, window):
        _write(out, event)
    return 0


def job_events(args: argparse.Namespace, window: Window) -> Iterator[dict[str, Any]]:
    """``dump --job``'s events as they arrive (``tdbg alerts --job`` reads them too)."""
    entries = job_entries_for(args, [args.target] if args.target is not None else [])
    events: RankEvents = queue.Queue()
    clients = []
    try:
        for entry in entries:  # a rank gone, refusing or not a socket: named, the others go on
            text = str(entry.socket)
            try:
                clients.append(attach_target(resolve(text), text, args.timeout, args))
            except (ConnectError, ProtocolError, OSError) as exc:
                say_rank_failed(rank_of(entry), str(exc) or type(exc).__name__)
        if not clients:
            raise CliError(f"no rank of job {args.job} could be reached")
        judge = _JobJudge(str(args.job), window.history)
        threads = [
            threading.Thread(
                target=_read_rank,
                args=(c, args.timeout, window, events, judge.tap(c.run)),
                daemon=True,
            )
            for c in clients
        ]
        for thread in threads:
            thread.start()
        done = 0
        while done < len(threads):
            event = next_item(events)  # a Ctrl-C on any thread stops a stalled job's dump
            if event is None:
                done += 1
            else:
                yield event
            yield from judge.judge(final=done == len(threads))
    finally:
        for client in clients:
            client.close()


def _write(out: TextIO, event: dict[str, Any]) -> None:
    out.write(json.dumps(event, separators=(",", ":")) + "\n")
    out.flush()


class _JobJudge:
    """The job's model as ``dump --job`` reads it: each rank's RunState, folded on its reader
    thread, judged on the main thread by the same rules as the TUI's job screen."""

    def __init__(self, job: str, history: bool) -> None:
        from tdbg.model.job import Job  # numpy: loaded by `dump --job` only
        from tdbg.model.job_alerts import JobAlerts

        self.job = job
        self.history = history  # the window prints history: findings judged on it are printed
        self.model = Job(job, {})
        self.alerts = JobAlerts()
        self.lock = threading.Lock()
        self.replaying: set[int] = set()  # ranks still sending their history
        # Ranks whose history has all arrived but has not been judged as history yet: the
        # next judgement (at once, whatever the throttle) still counts it as history.
        self.synced: set[int] = set()
        self.judged_at = 0.0
        self.said_slowest: object = None  # the named slowest ranks last printed

    def tap(self, run: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        """What a rank's reader thread calls with each of its wire messages."""
        from tdbg.model.run_state import RunState

        rank = int(run.get("rank") or 0)
        state = RunState(run)
        state.mark("live")
        with self.lock:
            self.model.ranks[rank] = state
            self.model.ranks = dict(sorted(self.model.ranks.items()))
            self.replaying.add(rank)

        def fold(message: dict[str, Any]) -> None:
            with self.lock:
                state.apply(message)
                if message.get("type") in ("synced", "bye"):
                    self.synced.add(rank)
                if message.get("type") == "bye":
                    state.mark("ended", str(message.get("reason") or "closed"))

        return fold

    def judge(self, final: bool = False) -> list[dict[str, Any]]:
        """The job alerts raised or cleared since the last judgement, as events (at most every
        JUDGE_SECONDS, and once more at the end)."""
        from tdbg.cli.dump import job_alert_event

        now = time.monotonic()
        with self.lock:
            if not (final or self.synced & self.replaying) and now - self.judged_at < JUDGE_SECONDS:
                return []
            self.judged_at = now
            history = bool(self.replaying)
            changed = self.alerts.update(self.model)
            self.replaying -= self.synced
        if history and not self.history:
            return []  # --follow: what the ranks' histories held is not news
        out = [job_alert_event(a, self.job, history) for a in changed]
        return out + self._slowest(final, history)

    def _slowest(self, final: bool, history: bool) -> list[dict[str, Any]]:
        """A ``slowest_over_time`` event when the ranks named repeatedly slowest change (a rank
        named, its kind changes, or it is named no more), and at the end."""
        record = self.alerts.history
        named = [(r.rank, r.kind) for r in record.named()]
        if record.since is None or (named == self.said_slowest and not final):
            return []
        self.said_slowest = named
        event = {"type": "slowest_over_time", "job": self.job, **record.to_json()}
        if history:
            event["history"] = True
        return [event]


def _read_rank(
    client: Any,
    timeout: float | None,
    window: Window,
    events: RankEvents,
    tap: Callable[[dict[str, Any]], None],
) -> None:
    try:
        for event in windowed(dump_events(client, timeout, tap), window):
            events.put(event)
    except Exception as exc:  # a rank's stream broke: say so in its stream, the others go on
        events.put({"type": "end", "reason": f"error: {exc}", "rank": client.run.get("rank")})
    finally:
        events.put(None)
