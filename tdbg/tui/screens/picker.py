"""RunPickerScreen: several runs are live; each row fills in its step, loss, age and health."""

from __future__ import annotations

import threading
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from tdbg.connect.runtime import RunEntry
from tdbg.tui.peek import Glance, peek

# Runs peeked at once: each reads a history, so a machine with fifty runs is not asked all at
# once; the rows fill in as they answer.
PEEKS_AT_ONCE = 4
_peeks = threading.BoundedSemaphore(PEEKS_AT_ONCE)


class RunPickerScreen(ModalScreen[RunEntry | None]):
    """Pick a run. ``attached`` is the run on screen when switching (Esc stays on it); without
    it this is the first choice (Esc quits). With ``peek``, a short look at each run (local
    runs only) fills in its row."""

    BINDINGS = [Binding("escape", "cancel", "Quit")]

    class Peeked(Message):
        def __init__(self, index: int, glance: Glance) -> None:
            super().__init__()
            self.index = index
            self.glance = glance

    def __init__(
        self, entries: list[RunEntry], attached: Path | None = None, peek: bool = False
    ) -> None:
        super().__init__()
        self.entries = entries
        self.attached = attached
        self.peeking = peek
        self.glances: dict[int, Glance] = {}  # what each row's peek saw (tests read it too)

    def compose(self) -> ComposeResult:
        if self.attached is None:
            title = f"{len(self.entries)} runs are live — Enter attaches"
        else:
            title = "Switch run — Enter attaches, Esc stays on this one"
        with Vertical(id="picker-box"):
            yield Static(title, id="picker-title")
            yield OptionList(
                *(Option(self.row(i), id=str(i)) for i in range(len(self.entries))),
                id="picker-list",
            )

    def on_mount(self) -> None:
        if self.peeking:
            for index, entry in enumerate(self.entries):
                self._peek(index, entry)

    def row(self, index: int) -> Text:
        """``name  pid  rank`` (``← on screen`` for the attached run), what the peek saw (or
        an ellipsis while it looks), then the command line, which the row may cut."""
        entry = self.entries[index]
        if not self.peeking:  # as the entry describes itself (a remote one leads with its node)
            return Text(entry.describe())
        text = Text(f"{entry.name}  pid {entry.pid}  rank {entry.meta.get('rank', 0)}")
        if self.attached is not None and entry.socket == self.attached:
            text.append("  ← on screen", "bold")
        glance = self.glances.get(index)
        if glance is not None:
            text.append("  ")
            text.append_text(Text.from_markup(glance.markup()))
        else:
            text.append("  …", "dim")
        argv = " ".join(str(a) for a in entry.meta.get("argv") or [])
        if argv:
            text.append(f"  {argv}", "dim")
        return text

    @work(thread=True, group="peek", exit_on_error=False)
    def _peek(self, index: int, entry: RunEntry) -> None:
        with _peeks:
            glance = peek(entry)
        self.post_message(self.Peeked(index, glance))

    def on_run_picker_screen_peeked(self, event: Peeked) -> None:
        self.glances[event.index] = event.glance
        self.query_one(OptionList).replace_option_prompt(str(event.index), self.row(event.index))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.entries[int(event.option.id or 0)])

    def action_cancel(self) -> None:
        self.dismiss(None)
