"""ModelInfoScreen: what the run trains — the model summary, read from the run's state."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType

from tdbg.model.model_summary import ModelSummary, render_summary
from tdbg.tui.screens.text_box import TextBoxScreen


def summary_text(summary: ModelSummary) -> Text:
    """The summary as ``tdbg summary`` prints it, its marks in the alert colours."""
    text = Text(no_wrap=True)
    looking = False
    for line in render_summary(summary, every=True).rstrip("\n").split("\n"):
        if line == "To look at:":
            looking = True
            text.append(line + "\n", "bold")
            continue
        style = "yellow" if looking else ("bold" if line.startswith("  layer ") else "")
        text.append(line + "\n", style)
    text.rstrip()
    return text


class ModelInfoScreen(TextBoxScreen):
    """The model summary, its rows one line each (scrolled sideways where they are wider)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *TextBoxScreen.BINDINGS,
        Binding("i", "close", "Close", show=False),
    ]
    DEFAULT_CSS = """
    ModelInfoScreen #text-box { width: 96%; max-width: 140; max-height: 92%; }
    """
    HINT = "↑ ↓ ← → PgUp PgDn scroll · escape closes"

    def __init__(self, summary: ModelSummary) -> None:
        super().__init__("model", summary_text(summary), wrap=False)
        self.summary = summary
