"""``tdbg-tui replay FILE`` and ``tdbg tui replay FILE``: the options, then the replay app."""

from __future__ import annotations

from collections.abc import Sequence

from tdbg.cli.args import OneLineParser


def replay_main(argv: Sequence[str]) -> int:
    """Parse ``FILE`` and show it; a usage error is one line on stderr and exit code 2."""
    parser = OneLineParser(
        prog="tdbg-tui replay",
        description="Show a recording (watch(record=...), TDBG_RECORD) in the monitor, with a "
        "cursor: ←/→ one step, shift+←/→ jump, home/end.",
    )
    parser.add_argument("file", help="a recording file")
    args = parser.parse_args(list(argv))
    if not args.file.strip():
        parser.error("FILE is empty")
    from tdbg.cli.launch import run_replay  # textual is loaded only for the TUI

    return run_replay(args.file)
