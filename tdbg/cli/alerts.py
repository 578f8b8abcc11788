"""``tdbg alerts [TARGET | --job JOB]``: each alert as it starts — a line, JSON, a command run, a
webhook posted — from beside the run (here or over ssh://), never inside it."""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from collections.abc import Iterator
from typing import Any, TextIO

from tdbg.cli.alert_fold import REARM_STEPS, AlertFold
from tdbg.cli.args import positive_float, positive_int
from tdbg.cli.deliver import EXEC_TIMEOUT_S, Sink, close_all, exec_sink, webhook_sink
from tdbg.cli.dump import Window, dump_events, recording_events, windowed
from tdbg.cli.errors import CliError
from tdbg.cli.job_targets import add_job_option, job_events
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, attach_target, target_arg
from tdbg.cli.webhook_template import TemplateError, WebhookTemplate, alert_fields
from tdbg.connect.targets import Job, Recording, resolve


def webhook_url(text: str) -> str:
    """argparse type of ``--webhook``: an http(s) URL with a host (urllib would also read
    file:// and ftp:// URLs, which are no webhooks)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError("--webhook: not an http:// or https:// URL with a host")
    return text


def add_alerts_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "alerts",
        help="each alert as it starts: a line or JSON, a command run, a webhook posted",
        description=(
            "Print each of a run's alerts as it starts (NaN/Inf and where it began, stalls, "
            "loss spikes, exploding or missing gradients; with --job also stragglers, diverged "
            "ranks and hangs), one per kind until it clears (repeats are folded), and deliver "
            "it: --exec runs a command with the alert as JSON on its standard input, --webhook "
            "posts it (Slack and Discord show it as is). It runs beside the run, never in it: a "
            "slow, failing or unreachable command or URL is retried with backoff, said once on "
            "stderr, and never delays the stream. Without --follow, the alerts the run already "
            "raised come first. Exit status: 0 the run ended (or the recording was read); "
            "2 no run, not a recording, bad arguments."
        ),
    )
    p.add_argument("target", nargs="?", type=target_arg, metavar="TARGET", help=TARGET_HELP)
    add_remote_options(p)
    add_job_option(p, "the alerts (and the job's own findings)")
    p.add_argument("--follow", action="store_true", help="only alerts raised from now on")
    p.add_argument("--json", action="store_true", help="each alert as one JSON object")
    p.add_argument(
        "--exec",
        dest="exec_command",
        metavar="CMD",
        help="run CMD (by the shell) for each alert, the alert as JSON on its standard input",
    )
    p.add_argument(
        "--exec-timeout",
        type=positive_float,
        default=EXEC_TIMEOUT_S,
        metavar="S",
        help=f"kill a command still running after S seconds (default {EXEC_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--webhook",
        type=webhook_url,
        metavar="URL",
        help="POST each alert as JSON to URL ({text, content, alert}: Slack and Discord show it); "
        "or set TDBG_WEBHOOK (a webhook's URL is its secret: kept out of argv, printed redacted)",
    )
    p.add_argument(
        "--webhook-template",
        metavar="TEMPLATE",
        help="post TEMPLATE (the text, or @FILE) instead, its fields filled in: ${kind} "
        "${level} ${message} ${run} ${step} ${host} ${time} ${where} ${json}; a template that "
        "starts with { or [ is JSON, each field escaped as the JSON around it needs "
        "(docs/automation.md)",
    )
    p.add_argument(
        "--rearm",
        type=positive_int,
        default=REARM_STEPS,
        metavar="N",
        help=f"an alert kind quiet for N steps is news again (default {REARM_STEPS})",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="wait at most S seconds for a run and stop after S seconds",
    )
    p.set_defaults(func=cmd_alerts)


def cmd_alerts(args: argparse.Namespace, out: TextIO) -> int:
    sinks: list[Sink] = []
    url = args.webhook or os.environ.get("TDBG_WEBHOOK")
    template = None
    if args.webhook_template is not None:
        if not url:
            raise CliError("--webhook-template needs --webhook URL (or TDBG_WEBHOOK)")
        try:
            template = WebhookTemplate.parse(args.webhook_template)
        except TemplateError as exc:
            raise CliError(f"--webhook-template: {exc}") from None
    if url:
        try:
            url = webhook_url(url)
        except argparse.ArgumentTypeError as exc:
            raise CliError(str(exc)) from None
    if args.exec_command:
        sinks.append(exec_sink(args.exec_command, args.exec_timeout))
    if url:
        sinks.append(webhook_sink(url, template))
    fold = AlertFold(rearm=args.rearm)
    runs: dict[Any, dict[str, Any]] = {}  # rank (None for a lone run) -> its hello's run
    try:
        for event in _events(args):
            if event.get("type") == "hello" and isinstance(event.get("run"), dict):
                runs[event.get("rank")] = event["run"]
            for notice in fold.feed(event):
                alert = notice.as_json()
                out.write((json.dumps(alert) if args.json else notice.line) + "\n")
                out.flush()
                run = runs.get(alert.get("rank")) or next(iter(runs.values()), {})
                fields = alert_fields(notice.line, alert, run)
                for sink in sinks:
                    sink.put({"line": notice.line, "alert": alert, "fields": fields})
    finally:
        close_all(sinks)  # what is queued goes out, within one bounded drain
    return 0


def _events(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The dump events the alerts come from: a job's ranks and findings, a recording, a run."""
    window = Window.of(args.follow, None, None)
    if args.job is not None:
        yield from job_events(args, window)
        return
    target = resolve(args.target)
    if isinstance(target, Job):  # the name the ranks of one job share: the job, as --job
        args.job, args.target = target.job, None
        yield from job_events(args, window)
        return
    if isinstance(target, Recording):
        from tdbg.recording.reader import RecordingError, open_recording

        if args.follow:
            raise CliError("--follow needs a live run: a recording has no new alerts")
        try:
            yield from recording_events(open_recording(target.path))
        except RecordingError as exc:
            raise CliError(str(exc)) from None
        return
    client = attach_target(target, args.target, args.timeout, args)
    try:
        yield from windowed(dump_events(client, args.timeout), window)
    finally:
        client.close()
