"""The ``tdbg`` command's entry point: ``tdbg bridge`` without importing every other command."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``tdbg ARGS``. ``tdbg bridge`` is what every node of a job starts (128 of them at once
    for a 1,024-rank job on one machine's simulation): it parses its own options only and
    leaves the other commands' modules unimported (~0.1 s of CPU on a 2-core VM)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bridge"] and not {"-h", "--help"} & set(args):
        return _bridge(args)
    from tdbg.cli.main import main as every_command

    return every_command(args)


def _bridge(args: list[str]) -> int:
    from tdbg.cli.args import OneLineParser
    from tdbg.cli.bridge import add_bridge_parser, cmd_bridge
    from tdbg.cli.ending import run_command

    parser = OneLineParser(prog="tdbg")
    add_bridge_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    parsed = parser.parse_args(args)
    return run_command(lambda: cmd_bridge(parsed, sys.stdout), "tdbg")
