"""``tdbg dump``'s console events, and ``--console``: the run's output lines as plain text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tdbg.model.console_log import plain
from tdbg.protocol.messages.console import STDERR, ConsoleLines


def console_events(msg: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A ``console`` message as one event a line (its unfinished lines are not events: they
    come again, finished, in a later message)."""
    lines = ConsoleLines.from_wire(msg)
    if lines is None:
        return
    for i, (stream, text) in enumerate(zip(lines.streams, lines.texts, strict=True)):
        event: dict[str, Any] = {
            "type": "console",
            "seq": lines.seq + i,
            "stream": "stderr" if stream == STDERR else "stdout",
            "text": text,
            "step": lines.step,
        }
        if lines.history:
            event["history"] = True
        yield event


def event_line(event: dict[str, Any], console: bool) -> str | None:
    """How ``tdbg dump`` prints an event: a JSON line; with ``--console`` only the console's
    lines, as text (an ``end`` that says why the stream stopped goes nowhere: stderr has it)."""
    if not console:
        return json.dumps(event, separators=(",", ":")) + "\n"
    if event.get("type") != "console":
        return None
    return plain(str(event.get("text", ""))) + "\n"
