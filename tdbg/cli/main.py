"""The ``tdbg`` (dump, ls, tui, profile, snapshot, nan-hunt, anomaly, activations) and ``tdbg-tui``
entry points; never imports torch, and imports rich only where a table is printed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from tdbg import __version__
from tdbg.cli.alerts import add_alerts_parser
from tdbg.cli.args import (
    EXIT_USAGE,
    OneLineParser,
    add_command_options,
    positive_float,
    positive_int,
)
from tdbg.cli.bridge import add_bridge_parser
from tdbg.cli.compare import add_compare_parser
from tdbg.cli.dives import (
    JobFailed,
    cmd_activations,
    cmd_anomaly,
    cmd_nan_hunt,
    cmd_profile,
    cmd_snapshot,
)
from tdbg.cli.dump import Window, dump_events, job_event, windowed
from tdbg.cli.dump_console import event_line
from tdbg.cli.ending import run_command
from tdbg.cli.errors import CliError
from tdbg.cli.export import add_export_parser
from tdbg.cli.job_dives import cmd_job_dive, rank_list
from tdbg.cli.job_targets import add_job_option, dump_job, job_by_name, job_entries_for
from tdbg.cli.report import PROFILE_COLUMNS
from tdbg.cli.run import add_run_parser
from tdbg.cli.run_report import add_report_parser
from tdbg.cli.status import add_status_parser
from tdbg.cli.summary import add_summary_parser
from tdbg.cli.target_args import (
    TARGET_HELP,
    add_remote_options,
    attach_target,
    remote_options,
    target_arg,
)
from tdbg.cli.tui_entry import add_tui_targets, cmd_tui, tui_main
from tdbg.connect.client import ConnectError
from tdbg.connect.nodes import node_targets
from tdbg.connect.runtime import discover, runtime_dir
from tdbg.connect.targets import Job, Recording, resolve
from tdbg.format import fmt_span, number

__all__ = ["CliError", "job_event", "main", "run", "tui_main"]


def cmd_dump(args: argparse.Namespace, out: TextIO) -> int:
    if args.job is not None:
        return dump_job(args, out)
    target = resolve(args.target)
    if isinstance(target, Job):  # the name the ranks of one job share: the job, as --job
        args.job, args.target = target.job, None
        return dump_job(args, out)
    if isinstance(target, Recording):
        from tdbg.cli.dump import dump_recording
        from tdbg.recording.reader import RecordingError

        if args.follow:
            raise CliError("--follow needs a live run: a recording has no new steps to wait for")
        try:
            window = Window.of_recording(args.last, args.count)
            return dump_recording(args.target, out, window, args.console)
        except RecordingError as exc:
            raise CliError(str(exc)) from None
    window = Window.of(args.follow, args.last, args.count)
    client = attach_target(target, args.target, args.timeout, args)
    try:
        for event in windowed(dump_events(client, args.timeout), window):
            line = event_line(event, args.console)
            if line is not None:
                out.write(line)
            if event["type"] == "end" and event.get("reason") == "slow_consumer":
                print(
                    "tdbg: the probe dropped this client: it read too slowly (over 1 MiB unread "
                    "for 10 s); the run goes on",
                    file=sys.stderr,
                    flush=True,
                )
            out.flush()
    finally:
        client.close()
    out.flush()
    return 0


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    if args.job is not None and (args.hosts or args.hostfile is not None):
        raise CliError("tdbg ls --job lists local ranks; for a job on ssh nodes: tdbg-tui --job")
    if args.hosts or args.hostfile is not None:
        return _ls_remote(args, out)
    entries = discover() if args.job is None else job_entries_for(args, [])
    if args.json:
        for e in entries:
            out.write(json.dumps(dict(e.meta, socket=str(e.socket))) + "\n")
        return 0
    if not entries:
        out.write(f"no tdbg runs in {runtime_dir()}\n")
        return 0
    for e in entries:
        out.write(_ls_line(e.meta, str(e.socket)))
    return 0


def _ls_line(meta: dict[str, Any], socket: str, node: str = "") -> str:
    start = number(meta.get("start_time"))
    if start is None:
        started = "started n/a"
    else:  # the clock time, and how long ago in the same spelling as the TUI's (`1m03s`)
        clock = time.strftime("%H:%M:%S", time.localtime(start))
        started = f"started {clock} ({fmt_span(time.time() - start)} ago)"
    name = str(meta.get("name") or "?")
    return (
        f"{node}{name:<20} pid {meta.get('pid', '?')!s:<8} rank {meta.get('rank', 0)!s:<3} "
        f"{started}  {socket}\n"
    )


def _ls_remote(args: argparse.Namespace, out: TextIO) -> int:
    """``tdbg ls ssh://node ...``: each node's runs through ``tdbg bridge --list``."""
    from tdbg.connect.ssh import list_runs

    opts = remote_options(args)
    targets = node_targets(args.hosts, args.hostfile, "tdbg ls lists this machine, or ssh:// nodes")
    failed = 0
    for target in targets:
        try:
            listing = list_runs(target, opts)
        except ConnectError as exc:  # one node down: say so, list the others
            print(f"tdbg: error: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        for run in listing.runs:
            socket = str(run.get("socket", ""))
            if args.json:
                out.write(json.dumps(dict(run, node=listing.target.node)) + "\n")
            else:
                out.write(_ls_line(run, socket, f"{listing.target.node}  "))
        if not listing.runs and not args.json:
            out.write(f"{listing.target.node}  no tdbg runs in {listing.runtime_dir}\n")
        out.flush()
    return EXIT_USAGE if failed else 0


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
    p.add_argument("target", nargs="?", type=target_arg, help=TARGET_HELP)
    add_remote_options(p)
    job = p.add_argument_group("a distributed job (its ranks on this machine)")
    job.add_argument(
        "--job",
        metavar="JOB",
        help="every rank of distributed job JOB at once, instead of one TARGET "
        "(tdbg status --json names the jobs); each result carries its rank",
    )
    job.add_argument(
        "--ranks",
        type=rank_list,
        metavar="LIST",
        help="with --job: only these ranks (0,2 or 0-3)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
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
    p.set_defaults(func=_one_or_job(func))
    return p


def _one_or_job(func: Callable[..., int]) -> Callable[..., int]:
    """A deep dive on its TARGET, or with ``--job`` on every chosen rank of the job."""

    def dive(args: argparse.Namespace, out: TextIO) -> int:
        if args.target is not None and not job_by_name(args, [args.target]):
            args.target = None  # the name the ranks of one job share: the job, as --job
        if args.job is not None or args.ranks is not None:
            return cmd_job_dive(args, out)
        return func(args, out)

    return dive


JOB_EPILOG = (
    "Exit status: 0 done; 1 the job failed or was cancelled; 2 bad arguments, no run, command "
    "refused, timeout, or the run ended first; 130 interrupted (the job is cancelled). "
    "With --job: a rank that refuses, times out, fails or has ended is one line on stderr and "
    "the others are reported; exit 0 when one rank answered or more, 2 when none did; 130 "
    "interrupted (the job is cancelled on every rank)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="tdbg", description="tdbg: live PyTorch training monitor")
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump = sub.add_parser(
        "dump",
        help="print a run's events as JSON lines",
        description="Print a run's events as JSON lines (docs/dump.md): by default its history "
        "(everything before `synced`), then live events until it ends.",
        epilog="Examples: `tdbg dump --count 1` the step the run takes next; `tdbg dump --last 1` "
        "the current step, at once; `tdbg dump --last 50 --follow` the last 50 steps, then live.",
    )
    dump.add_argument("target", nargs="?", type=target_arg, help=TARGET_HELP)
    add_remote_options(dump)
    dump.add_argument(
        "--follow",
        action="store_true",
        help="from now on: no history, only the events that arrive after attaching",
    )
    dump.add_argument(
        "--last",
        type=positive_int,
        metavar="N",
        help="of the history, only the last N steps and what happened in them; then stop "
        "(with --follow or --count: go on live)",
    )
    dump.add_argument(
        "--count",
        type=positive_int,
        metavar="N",
        help="stop after N live steps (taken after attaching); implies no history unless "
        "--last; of a recording, its first N steps",
    )
    dump.add_argument(
        "--console",
        action="store_true",
        help="only the run's console (its stdout and stderr lines), as plain text",
    )
    dump.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="wait at most S seconds for a run and stop after S seconds",
    )
    add_job_option(dump, "the events")
    dump.set_defaults(func=cmd_dump)
    ls = sub.add_parser("ls", help="list live runs on this machine (or on ssh:// nodes)")
    ls.add_argument("hosts", nargs="*", metavar="ssh://NODE", help="list the runs there instead")
    ls.add_argument("--json", action="store_true", help="one JSON object per run")
    ls.add_argument("--hostfile", metavar="FILE", help="list the runs of these nodes, one a line")
    add_remote_options(ls)
    add_job_option(ls, "the runs")
    ls.set_defaults(func=cmd_ls)
    tui = sub.add_parser("tui", help="the full-screen monitor (same as tdbg-tui)")
    add_tui_targets(tui)
    tui.set_defaults(func=cmd_tui)
    add_bridge_parser(sub)
    add_run_parser(sub)
    add_status_parser(sub)
    add_report_parser(sub)
    add_summary_parser(sub)
    add_alerts_parser(sub)
    add_compare_parser(sub)
    add_export_parser(sub)

    profile = _job_parser(
        sub,
        "profile",
        "torch.profiler over the next N steps: the top-ops table and the trace's path",
        "default: --max-seconds + 60",
        cmd_profile,
    )
    add_command_options(profile, "profile")
    profile.add_argument(
        "--sort",
        type=_sort_column,
        metavar="COLUMN",
        help="one of name, calls, self_cpu, cpu_total, self_device, device_total, cpu_memory, "
        "device_memory, share (default: device_total on device runs, else cpu_total)",
    )
    profile.add_argument("--rows", type=positive_int, default=20, metavar="N", help="default 20")

    snapshot = _job_parser(
        sub,
        "snapshot",
        "CUDA allocator history over the next N steps: the snapshot file and top allocation "
        "sites (CUDA runs only)",
        "default 120",
        cmd_snapshot,
    )
    add_command_options(snapshot, "snapshot")
    snapshot.add_argument(
        "--rows", type=positive_int, default=10, metavar="N", help="sites shown (default 10)"
    )

    nan_hunt = _job_parser(
        sub,
        "nan-hunt",
        "hooks on every module for up to N steps: the first module whose output or gradient "
        "is non-finite",
        "default 120",
        cmd_nan_hunt,
    )
    add_command_options(nan_hunt, "nan_hunt")

    anomaly = _job_parser(
        sub,
        "anomaly",
        "autograd anomaly detection for the next N steps (global and slow while on); backward "
        "errors are reported with the forward traceback",
        "default 120",
        cmd_anomaly,
    )
    add_command_options(anomaly, "anomaly")

    activations = _job_parser(
        sub,
        "activations",
        "per-module output statistics every K steps, or off",
        "default 60",
        cmd_activations,
    )
    which = activations.add_mutually_exclusive_group()
    add_command_options(which, "activations", skip={"enabled"})  # enabled=false is --off
    which.add_argument("--off", action="store_true", help="turn activation statistics off")
    activations.add_argument(
        "--show", action="store_true", help="wait for the next sampled step and print it"
    )
    for p in (profile, snapshot, nan_hunt, anomaly):
        p.epilog = JOB_EPILOG
    activations.epilog = (
        "Exit status: 0 done; 2 bad arguments, no run, command refused, timeout, or the run "
        "ended first; 130 interrupted (statistics stay as set). With --job: a rank that "
        "refuses, times out or has ended is one line on stderr; exit 0 when one rank answered "
        "or more, 2 when none did."
    )
    return parser


def run(argv: Sequence[str], prog: str = "tdbg") -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: args.func(args, sys.stdout), prog, failed=(JobFailed,))


def main(argv: Sequence[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
