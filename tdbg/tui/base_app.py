"""What every tdbg app shares: the stylesheet, the title, q and ?, and closing its source."""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding

from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.sources.base import Stoppable


class TdbgBaseApp(App[int]):
    """The run monitor and the job view are both this: a source read by a worker thread, state
    folded in handlers, and a revision painted on screen."""

    CSS_PATH = "tdbg.tcss"
    TITLE = "tdbg"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    source: Stoppable
    _painted = -1

    @property
    def painted_revision(self) -> int:
        """The state revision on screen (tests poll this instead of sleeping)."""
        return self._painted

    def ring(self, sequence: str) -> None:
        """Write the bell (or a notification's escape sequence) to the terminal, as App.bell()
        does; nothing in a headless app (a test) or before the driver starts."""
        driver = getattr(self, "_driver", None)
        if sequence and driver is not None and not self.is_headless:
            driver.write(sequence)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self.source.close()
        self.exit(0)

    def on_unmount(self) -> None:
        self.source.close()
