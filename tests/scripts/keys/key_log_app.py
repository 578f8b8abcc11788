"""A tdbg app with nothing on it that writes each key it is given to a file, one per line."""

from __future__ import annotations

import sys
from pathlib import Path

from textual import events
from textual.app import ComposeResult
from textual.widgets import Static

import tdbg.tui.base_app
from tdbg.tui.base_app import TdbgBaseApp
from tdbg.tui.sources.base import Stoppable


class KeyLogApp(TdbgBaseApp):
    # Textual finds a relative CSS path beside the subclass's module: the apps' stylesheet.
    CSS_PATH = str(Path(tdbg.tui.base_app.__file__).with_name("tdbg.tcss"))

    def __init__(self, log: str) -> None:
        super().__init__()
        self.source = Stoppable()  # nothing to read
        self._key_file = open(log, "a", encoding="utf-8")  # open while the app runs

    def compose(self) -> ComposeResult:
        yield Static("keys")

    def on_mount(self) -> None:
        super().on_mount()
        self._write(f"ready {type(self._driver).__name__}")

    def on_key(self, event: events.Key) -> None:
        self._write(event.key)

    def _write(self, line: str) -> None:
        self._key_file.write(line + "\n")
        self._key_file.flush()


if __name__ == "__main__":
    sys.exit(KeyLogApp(sys.argv[1]).run() or 0)
