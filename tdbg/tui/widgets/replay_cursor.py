"""ReplayCursor: the replay's position line — step at the cursor, of how many, and when."""

from __future__ import annotations

import time
from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from tdbg.format import fmt

KEYS = "←/→ step · ⇧←/⇧→ jump · home/end"


def _clock(when: float | None, spec: str) -> str:
    return "n/a" if when is None else time.strftime(spec, time.localtime(when))


class ReplayCursor(Static):
    """``replay · step 1204 / 5000 (#1205 of 5001 recorded) · at 12:03:04 · recorded …``."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"replay-cursor--step", "replay-cursor--dim"}

    def show(
        self,
        step: int | None,
        last_step: int | None,
        index: int,
        total: int,
        at: float | None,
        recorded: float | None,
        note: str | None,
    ) -> None:
        strong = self.get_component_rich_style("replay-cursor--step")
        dim = self.get_component_rich_style("replay-cursor--dim")
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("replay · ")
        text.append(f"step {fmt(step, 'd')} / {fmt(last_step, 'd')}", strong)
        text.append(f" ({index + 1 if total else 0} of {total} recorded)", dim)
        text.append(f" · at {_clock(at, '%H:%M:%S')}")
        text.append(f" · recorded {_clock(recorded, '%Y-%m-%d %H:%M')}", dim)
        if note:  # before the keys: on a narrow terminal the end of the line is cut
            text.append(f" · {note}", strong)
        text.append(f" · {KEYS}", dim)
        self.update(text)
