"""WaitingScreen: no run yet; discovery keeps polling and attaches as soon as one appears."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import LoadingIndicator, Static

from tdbg.connect.runtime import runtime_dir
from tdbg.tui.widgets.steady_footer import SteadyFooter


class WaitingScreen(Screen[None]):
    def __init__(self, directory: str = "") -> None:
        super().__init__()
        self.directory = directory or str(runtime_dir())

    def compose(self) -> ComposeResult:
        with Vertical(id="waiting-box"):
            yield Static("Waiting for a training run…", id="waiting-title")
            yield Static(
                f"Watching {self.directory}. Start a script that calls tdbg.watch(model, "
                "optimizer); this screen attaches as soon as it appears.",
                id="waiting-text",
            )
            yield LoadingIndicator()
        yield SteadyFooter()
