"""LearningRates: the current learning rate of every param group, labelled by its optimizer, with
a sparkline of its history."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from rich.style import Style
from rich.text import Text

from tdbg.format import fmt
from tdbg.model.cursor import lr_at
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.glyphs import spark
from tdbg.tui.widgets.steady import SteadyStatic


class LearningRates(SteadyStatic):
    COMPONENT_CLASSES: ClassVar[set[str]] = {"learning-rates--spark", "learning-rates--zero"}

    def show(self, state: RunState, cursor: int | None = None) -> None:
        """Each group's latest rate and its history; with the inspect cursor on, the rate at
        the cursor's step instead, and a mark under the sparkline where that step lies."""
        latest = state.latest_lr() if cursor is None else lr_at(state, cursor)
        if not latest:
            self.update("n/a (no learning rate reported)")
            return
        width = max(8, self.content_size.width)
        history = state.lr.values
        text = Text(no_wrap=True, overflow="crop")
        labels = state.lr_labels(len(latest))
        pad = max(8, *(len(label) for label in labels)) if labels else 8
        for g, value in enumerate(latest):
            if g:
                text.append("\n")
            zero = value == 0
            text.append(f"{labels[g]:<{pad}} ")
            text.append(f"{fmt(value, '.3e'):>10}\n", self._style(zero))
            column = history[:, g] if g < history.shape[1] else np.empty(0)
            # A step with fewer learning rates (before this optimizer came) has none here: a
            # blank, not the "!" of an unreadable one.
            none = state.lr_n.values[: len(column)] <= g
            # Bucket to the width so the sparkline covers the whole run, not just its tail.
            if len(column) > width:
                edges = np.linspace(0, len(column), width + 1).astype(np.int64)
                column, none = column[edges[:-1]], none[edges[:-1]]
            text.append(
                spark(column, width, gaps=none),
                self.get_component_rich_style("learning-rates--spark"),
            )
        if cursor is not None:
            text.append(f"\n{self._cursor_mark(state, cursor, width)}")
        self.update(text)

    @staticmethod
    def _cursor_mark(state: RunState, cursor: int, width: int) -> str:
        """``▲ step N`` under the sparklines' column for the cursor's step."""
        steps = state.steps.values
        n = len(steps)
        i = int(np.searchsorted(steps, cursor, side="right")) - 1
        column = 0 if n <= 1 else min(width - 1, max(0, i) * min(n, width) // n)
        label = f"▲ step {cursor}"
        if column + len(label) <= width:
            return " " * column + label
        label = f"step {cursor} ▲"  # near the right edge: the label ends at the mark
        return " " * max(0, column + 1 - len(label)) + label

    def _style(self, zero: bool) -> Style | str:
        return self.get_component_rich_style("learning-rates--zero") if zero else ""
