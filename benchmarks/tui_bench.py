"""What the tmux TUI benchmarks (tui.py, job_tui.py) share around their repeats: the options,
the tree whose tdbg runs (``--source``, ``--head``) and the raw results file (``--json``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def add_bench_options(parser: argparse.ArgumentParser, presses: int, profile_help: str) -> None:
    """The options every TUI benchmark takes; ``presses`` is its default count of each key."""
    parser.add_argument("--quick", action="store_true", help="one repeat, short windows (< 2 min)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per CPU window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument(
        "--presses", type=int, default=presses, help="presses of each key per repeat"
    )
    parser.add_argument("--gap", type=float, default=0.15, help="seconds between presses")
    parser.add_argument("--profile", action="store_true", help=profile_help)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--source", type=Path, default=ROOT, help="the tree whose tdbg runs")
    parser.add_argument("--head", action="store_true", help="run a snapshot of the last commit")


def shorten_for_quick(args: argparse.Namespace, presses: int | None = None) -> None:
    """``--quick``: one repeat, short windows (and ``presses`` presses of each key, if given)."""
    if args.quick:
        args.repeats, args.window, args.warmup = 1, 8.0, 3.0
        if presses is not None:
            args.presses = presses


@contextmanager
def workdir(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """A temporary directory for the repeats; with ``--head``, ``args.source`` becomes the last
    commit's tdbg extracted there. Says which tree runs."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if args.head:
            args.source = head_snapshot(Path(tmp))
        print(f"tdbg from {args.source}", flush=True)
        yield Path(tmp)


def save_results(args: argparse.Namespace, results: list[Any]) -> None:
    """The raw results (dataclasses) as JSON to ``--json``, when given."""
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))


def head_snapshot(tmp: Path) -> Path:
    """The last commit's ``tdbg`` package, extracted under ``tmp`` (its PYTHONPATH entry)."""
    source = tmp / "head"
    source.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD", "tdbg"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    return source
