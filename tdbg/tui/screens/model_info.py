"""ModelInfoScreen: what the run trains — the model summary, read from the run's state."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import ScrollableContainer, Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from tdbg.model.model_summary import ModelSummary, render_summary


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


class ModelInfoScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("i", "close", "Close", show=False),
    ]
    DEFAULT_CSS = """
    ModelInfoScreen { align: center middle; }
    #model-box {
        width: 96%;
        max-width: 140;
        height: auto;
        max-height: 92%;
        border: round $accent;
        background: $surface;
        padding: 0 1;
    }
    #model-title { text-style: bold; color: $accent; }
    #model-scroll { height: auto; max-height: 100%; }
    #model-text { width: auto; text-wrap: nowrap; }
    #model-hint { color: $foreground-muted; }
    """

    def __init__(self, summary: ModelSummary) -> None:
        super().__init__()
        self.summary = summary

    def compose(self) -> ComposeResult:
        with Vertical(id="model-box"):
            yield Static("model", id="model-title")
            # Both ways: a row stays one line (layer names can be long), as in `tdbg summary`.
            with ScrollableContainer(id="model-scroll"):
                yield Static(summary_text(self.summary), id="model-text")
            yield Static("↑ ↓ ← → PgUp PgDn scroll · escape closes", id="model-hint")

    def on_mount(self) -> None:
        self.query_one("#model-scroll").focus()

    def action_close(self) -> None:
        self.dismiss(None)
