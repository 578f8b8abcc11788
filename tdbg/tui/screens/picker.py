"""RunPickerScreen: several runs are live; pick one with Enter."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from tdbg.connect.runtime import RunEntry


class RunPickerScreen(ModalScreen[RunEntry | None]):
    BINDINGS = [Binding("escape", "cancel", "Quit")]

    def __init__(self, entries: list[RunEntry]) -> None:
        super().__init__()
        self.entries = entries

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box"):
            yield Static(f"{len(self.entries)} runs are live — Enter attaches", id="picker-title")
            yield OptionList(
                *(Option(e.describe(), id=str(i)) for i, e in enumerate(self.entries)),
                id="picker-list",
            )

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.entries[int(event.option.id or 0)])

    def action_cancel(self) -> None:
        self.dismiss(None)
