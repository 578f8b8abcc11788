"""TextBoxScreen: a titled box of text over the screen, scrolled from the keyboard, Esc closes."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import ScrollableContainer, Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class TextBoxScreen(ModalScreen[None]):
    """A title, a text and the keys that scroll it; ``wrap=False`` keeps each line one line
    (a table's rows) and scrolls sideways instead."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("enter", "close", "Close", show=False),
    ]
    DEFAULT_CSS = """
    TextBoxScreen { align: center middle; }
    #text-box {
        width: 90%;
        max-width: 110;
        height: auto;
        max-height: 90%;
        border: round $accent;
        background: $surface;
        padding: 0 1;
    }
    #text-title { text-style: bold; color: $accent; }
    #text-scroll { height: auto; max-height: 100%; }
    #text-body.-nowrap { width: auto; text-wrap: nowrap; }
    #text-hint { color: $foreground-muted; }
    """
    HINT = "↑ ↓ PgUp PgDn scroll · escape closes"

    def __init__(self, title: str, body: Text, wrap: bool = True) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.wrap = wrap

    def compose(self) -> ComposeResult:
        with Vertical(id="text-box"):
            yield Static(self.title_text, id="text-title")
            with ScrollableContainer(id="text-scroll"):
                yield Static(self.body, id="text-body", classes="" if self.wrap else "-nowrap")
            yield Static(self.HINT, id="text-hint")

    def on_mount(self) -> None:
        self.query_one("#text-scroll").focus()

    def action_close(self) -> None:
        self.dismiss(None)
