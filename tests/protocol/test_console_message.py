"""The ``console`` message: round trip, and what a malformed one reads as (never a raise)."""

from __future__ import annotations

from typing import Any

import pytest

from tdbg.protocol.framing import MAX_OUTBOUND_FRAME, Decoder, pack
from tdbg.protocol.messages.console import MAX_LINE, MAX_LINES, STDERR, STDOUT, ConsoleLines


def test_round_trip_through_a_frame() -> None:
    lines = ConsoleLines(
        7, (STDOUT, STDERR), ("héllo", "\x1b[31mwarn\x1b[0m"), ((STDERR, "40%"),), 3
    )
    decoder = Decoder(MAX_OUTBOUND_FRAME, expect_preamble=False)
    frame = pack(lines.to_wire())
    messages = [m for i in range(len(frame)) for m in decoder.feed(frame[i : i + 1])]
    (message,) = messages  # fed a byte at a time
    assert ConsoleLines.from_wire(message) == lines
    replayed = ConsoleLines(0, (), (), history=True)
    assert ConsoleLines.from_wire(replayed.to_wire()) == replayed


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"type": "console"}, None),
        ({"seq": -1, "text": ["a"]}, None),
        ({"seq": True, "text": ["a"]}, None),
        ("not a map", None),
        # A text that is not a string reads as empty; a missing or unknown stream as stdout.
        ({"seq": 1, "text": ["a", 5], "stream": [9]}, ConsoleLines(1, (1, 1), ("a", ""))),
        ({"seq": 0, "text": ["x" * (MAX_LINE + 5)]}, ConsoleLines(0, (1,), ("x" * MAX_LINE,))),
        (
            {"seq": 0, "text": [], "open": [[2, "bar"], ["bad"], [1, 3], [1, "x"], [1, "y"]]},
            ConsoleLines(0, (), (), ((STDERR, "bar"),)),
        ),
        ({"seq": 2, "text": ["a"], "step": -4}, ConsoleLines(2, (1,), ("a",))),
    ],
)
def test_malformed_reads_as_what_is_well_formed(
    message: Any, expected: ConsoleLines | None
) -> None:
    assert ConsoleLines.from_wire(message) == expected


def test_a_message_holds_at_most_max_lines() -> None:
    read = ConsoleLines.from_wire({"seq": 0, "text": ["a"] * (MAX_LINES + 10)})
    assert read is not None and len(read.texts) == MAX_LINES == len(read.streams)
