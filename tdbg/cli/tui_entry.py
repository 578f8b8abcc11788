"""`tdbg-tui`'s entry: its arguments and which screen they open, without the rest of the CLI
(the subcommands' imports cost the TUI's first frame ~0.1 s)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tdbg import __version__
from tdbg.cli.args import EXIT_USAGE, OneLineParser
from tdbg.cli.errors import CliError
from tdbg.cli.replay import replay_main
from tdbg.cli.target_args import TARGET_HELP, add_remote_options, target_arg
from tdbg.connect.sshurl import is_ssh_url


def cmd_tui(args: argparse.Namespace, out: TextIO) -> int:
    extra = list(getattr(args, "extra_targets", None) or [])
    if args.target == "replay":  # `tdbg tui replay FILE`, as `tdbg-tui replay FILE`
        return replay_main(extra)
    if getattr(args, "no_bell", False):
        os.environ["TDBG_BELL"] = "0"  # the app reads it (tdbg.tui.ringer), whichever app runs

    compare = list(getattr(args, "compare", None) or [])
    if args.job is None and extra and _all_recordings([str(args.target), *extra]):
        # `tdbg-tui A.tdbg B.tdbg ...`: A replayed, the others drawn under its loss.
        compare, extra = [*extra, *compare], []
        args.extra_targets = []
    recordings = _job_recordings(args.job, [str(args.target or ""), *map(str, extra)])
    if recordings:  # `--job DIR` or `--job A.rank0.tdbg B.rank1.tdbg`: a job replayed
        from tdbg.cli.launch import launch_job_replay
        from tdbg.recording.reader import RecordingError

        try:
            return launch_job_replay(recordings)
        except RecordingError as exc:
            raise CliError(str(exc)) from None
    hosts = getattr(args, "hosts", None) or []
    texts = [t for t in (args.target, *extra, *hosts) if t is not None]
    if args.hostfile is not None or any(is_ssh_url(t) for t in texts):  # nodes: a job, or runs
        from tdbg.cli.launch import launch_nodes  # textual: for the TUI only

        return launch_nodes(texts, args.hostfile, args.job, args.ssh_options, args.remote_tdbg)
    local = args.target is None and not extra and not hosts
    if args.job is not None or local:  # a distributed job: its ranks on one screen
        spawned = None
        if args.job is not None:
            # A large job's bridge starts now, before textual's imports (~1 s on a busy 2-core
            # machine): the two start side by side, and the first frame comes ~1 s sooner.
            from tdbg.connect.node_link import spawn_local_bridge

            spawned = spawn_local_bridge(args.job)
        from tdbg.cli.launch import launch_job

        code = launch_job(args.job, spawned=spawned)
        if code is not None:
            return code
    from tdbg.cli.launch import launch

    return launch(
        args.target,
        [*getattr(args, "extra_targets", []), *(getattr(args, "hosts", None) or [])],
        ssh_options=args.ssh_options,
        remote_tdbg=args.remote_tdbg,
        compare=compare,
    )


def _all_recordings(texts: list[str]) -> bool:
    from tdbg.recording.reader import is_recording

    return all(Path(t).is_file() and is_recording(t) for t in texts)


def _job_recordings(job: str | None, targets: list[str]) -> list[Path]:
    """The ranks' recordings ``--job`` names (a directory of them, or files, the targets after
    it included); [] when ``--job`` names a job id."""
    from tdbg.recording.reader import is_recording

    if job is None or not Path(job).exists():
        return []
    if not (Path(job).is_dir() or is_recording(job)):
        raise CliError(f"--job: {job} is not a tdbg recording (nor a directory of them)")
    if Path(job).is_dir():
        found = sorted(p for p in Path(job).iterdir() if p.is_file() and is_recording(p))
        if not found:
            raise CliError(f"--job {job}: no tdbg recordings in that directory")
        return found
    files = [Path(job), *(Path(t) for t in targets if t)]
    for path in files:
        if not is_recording(path):
            raise CliError(f"--job: {path} is not a tdbg recording")
    return files


def add_tui_targets(parser: argparse.ArgumentParser) -> None:
    """tdbg-tui's targets: one, or several ssh:// URLs (one per node; --host is an alias)."""
    parser.add_argument("target", nargs="?", type=target_arg, help=TARGET_HELP)
    parser.add_argument(
        "extra_targets",
        nargs="*",
        type=target_arg,
        metavar="TARGET",
        help="more ssh:// targets, one per node",
    )
    parser.add_argument(
        "--host", dest="hosts", action="append", metavar="URL", help="an ssh:// target"
    )
    parser.add_argument(
        "--job",
        metavar="JOB",
        help="every rank of distributed job JOB on one screen (local, or on the ssh:// nodes); "
        "or a directory of the ranks' recordings (or the recordings, one per rank) replayed as "
        "one job",
    )
    parser.add_argument(
        "--hostfile",
        metavar="FILE",
        help="the nodes, one a line ([user@]host[:port] or ssh:// URL; # comments; braces "
        "like gpu{01..08} expand)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        metavar="FILE",
        help="a recording to draw under this run's loss, up to its step (repeatable); "
        "`tdbg-tui A.tdbg B.tdbg` replays A with B under it",
    )
    parser.add_argument(
        "--no-bell",
        action="store_true",
        help="no terminal bell (nor desktop notification) on the first alert of each kind, "
        "or on the job screen the first finding of each kind (or TDBG_BELL=0)",
    )
    add_remote_options(parser)


def tui_main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "replay":  # tdbg-tui replay FILE: a recording, with a cursor
        try:
            return replay_main(list(argv[1:]))
        except KeyboardInterrupt:
            return 130
    parser = OneLineParser(
        prog="tdbg-tui",
        description="Full-screen monitor of a PyTorch run. With no TARGET: attach to the only "
        "local run, pick among several, or wait for one to start.",
    )
    add_tui_targets(parser)
    parser.add_argument("--version", action="version", version=f"tdbg {__version__}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return cmd_tui(args, sys.stdout)
    except CliError as exc:  # bad input (e.g. --job DIR with no recordings): one line
        print(f"tdbg-tui: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
