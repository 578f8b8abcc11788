"""What every tdbg app shares: the stylesheet, the title, q and ?, and closing its source."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from textual.app import App
from textual.binding import Binding
from textual.driver import Driver
from textual.theme import Theme

from tdbg.tui.colours import SUFFIX, base_name, colour_blind
from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.settings import PALETTES, load_settings, save_settings, settings_path
from tdbg.tui.sources.base import Stoppable

LINUX_DRIVER = "textual.drivers.linux_driver"
HELP = "help"  # the installed help screen's name


class TdbgBaseApp(App[int]):
    """The run monitor and the job view are both this: a source read by a worker thread, state
    folded in handlers, and a revision painted on screen."""

    CSS_PATH = "tdbg.tcss"
    TITLE = "tdbg"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("C", "cycle_palette", "Colours", show=False),
    ]

    source: Stoppable
    _painted = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read before the first frame, so that it already has the user's theme and palette;
        # a file that cannot be used is said once the app runs (a toast), never a traceback.
        self.settings_file = settings_path()
        self.settings, self._settings_warning = load_settings(self.settings_file)
        self._saved = asdict(self.settings)
        self._save_failed = False
        self._applying_theme = False

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for this platform, its Linux one with tdbg's quicker Esc (the
        Windows, web and headless drivers as Textual picks them)."""
        driver_class = super().get_driver_class()
        # By name: importing the Linux driver to compare would fail on Windows (termios).
        if (driver_class.__module__, driver_class.__name__) == (LINUX_DRIVER, "LinuxDriver"):
            from tdbg.tui.driver import TdbgLinuxDriver

            return TdbgLinuxDriver
        return driver_class

    def on_mount(self) -> None:
        self._apply_theme(self.settings.theme, self.settings.palette)
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        if self._settings_warning:
            self.notify(self._settings_warning, severity="warning", timeout=8)

    # --- settings ---------------------------------------------------------------------------

    def remember(self, **changes: Any) -> None:
        """Change settings and write them, only when that changes the file (a key that pans
        the chart costs no write); a directory that cannot be written is said once."""
        for name, value in changes.items():
            setattr(self.settings, name, value)
        now = asdict(self.settings)
        if now == self._saved:
            return
        try:
            save_settings(self.settings, self.settings_file)
        except OSError as exc:
            if not self._save_failed:
                self._save_failed = True
                why = exc.strerror or type(exc).__name__
                self.notify(f"settings not saved ({self.settings_file}: {why})", severity="warning")
            return
        self._saved = now

    def _apply_theme(self, theme: str | None, palette: str) -> None:
        """Show ``theme`` (None or unknown: the current one) in ``palette``."""
        base = theme if theme in self.available_themes else base_name(self.theme)
        name = base
        if palette == "colour-blind":
            name = base + SUFFIX
            if name not in self.available_themes:
                self.register_theme(colour_blind(self.available_themes[base]))
        if name != self.theme:
            self._applying_theme = True
            try:
                self.theme = name
            finally:
                self._applying_theme = False

    def _theme_changed(self, theme: Theme) -> None:
        """A theme picked in the command palette: kept, in the palette chosen."""
        if self._applying_theme:
            return
        base = base_name(theme.name)
        if self.settings.palette == "colour-blind" and not theme.name.endswith(SUFFIX):
            self._apply_theme(base, "colour-blind")
        self.remember(theme=base)

    def action_cycle_palette(self) -> None:
        """C: the colours that carry meaning, from the theme or colour-blind safe."""
        palette = PALETTES[(PALETTES.index(self.settings.palette) + 1) % len(PALETTES)]
        self._apply_theme(base_name(self.theme), palette)
        self.remember(palette=palette)
        self.notify(f"colours: {palette}", timeout=2)
        self.palette_changed()

    def palette_changed(self) -> None:
        """Repaint what draws colours outside the stylesheet; the apps override it."""

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
        # Built once and kept (installed), shown and hidden after that: composing, styling and
        # laying out its widgets again at each ? was most of the key's time (benchmarks/tui.py).
        if isinstance(self.screen, HelpScreen):
            return
        if not self.is_screen_installed(HELP):
            self.install_screen(HelpScreen(), HELP)
        self.push_screen(HELP)

    async def action_quit(self) -> None:
        self.source.close()
        self.exit(0)

    def on_unmount(self) -> None:
        self.source.close()
