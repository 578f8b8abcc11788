"""ConsoleScreen: the run's stdout and stderr, scrolled and searched (``j`` on the monitor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Input, Static

from tdbg.model.console_log import ConsoleLine, matches
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.console_view import ConsoleView

REPAINT = 0.25  # seconds between looks at the run's state (live: new lines)
HINT = "/ search · n N next / previous match · ↑ ↓ PgUp PgDn Home End · escape back"


class ConsoleScreen(Screen[None]):
    """The console lines the probe captured (its newest 5,000), the tail followed unless the
    user scrolled up; ``/`` searches (smartcase), ``n`` / ``N`` go to the next / previous
    match, escape clears a search, then goes back. It reads the run's state through ``source``
    (live, or a replay's cursor) on a timer, and redraws only when the lines changed."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "Back"),
        Binding("j", "close", "Back", show=False),
        Binding("slash", "search", "Search"),
        Binding("n", "next_match(1)", "Next match"),
        Binding("N", "next_match(-1)", "Previous match", key_display="N"),
    ]
    DEFAULT_CSS = """
    ConsoleScreen #console-title { text-style: bold; color: $accent; }
    ConsoleScreen #console-foot, ConsoleScreen #console-hint { color: $foreground-muted; }
    ConsoleScreen #console-search { display: none; height: 1; border: none; padding: 0 1; }
    ConsoleScreen #console-search.-open { display: block; }
    """

    def __init__(self, source: Callable[[], RunState | None]) -> None:
        super().__init__()
        self._source = source
        self.search_text = ""
        self.lines: list[ConsoleLine] = []
        self.matched: list[int] = []
        self.current: int | None = None  # index into self.lines of the match shown
        self._seen: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Static("Console", id="console-title")
        yield ConsoleView(id="console-view")
        yield Input(placeholder="search the console", id="console-search")
        yield Static("", id="console-foot")
        yield Static(HINT, id="console-hint")

    def on_mount(self) -> None:
        self.query_one(ConsoleView).focus()
        self.repaint()
        self.set_interval(REPAINT, self.repaint)

    # --- keys -------------------------------------------------------------------------------
    def action_close(self) -> None:
        self.dismiss(None)

    def action_back(self) -> None:
        search = self.query_one("#console-search", Input)
        if search.has_class("-open") or self.search_text:
            search.remove_class("-open")
            search.value = ""
            self._search("", keep_open=False)
            self.query_one(ConsoleView).focus()
            return
        self.dismiss(None)

    def action_search(self) -> None:
        search = self.query_one("#console-search", Input)
        search.add_class("-open")
        search.focus()

    def action_next_match(self, direction: int) -> None:
        if not self.matched:
            return
        if self.current is None:  # from where the user is looking
            view = self.query_one(ConsoleView)
            top = view.scroll_offset.y
            if direction > 0:
                below = [i for i in self.matched if i >= top]
                self.current = below[0] if below else self.matched[0]
            else:
                above = [i for i in self.matched if i < top + view.size.height]
                self.current = above[-1] if above else self.matched[-1]
        else:
            k = self.matched.index(self.current) if self.current in self.matched else -1
            self.current = self.matched[(k + direction) % len(self.matched)]
        self._draw()
        self.query_one(ConsoleView).go_to(self.current)

    @on(Input.Changed, "#console-search")
    def _typed(self, event: Input.Changed) -> None:
        self._search(event.value, keep_open=True)

    @on(Input.Submitted, "#console-search")
    def _submitted(self, event: Input.Submitted) -> None:
        self.query_one("#console-search", Input).remove_class("-open")
        self.query_one(ConsoleView).focus()
        if self.matched and self.current is None:
            self.action_next_match(1)

    def _search(self, query: str, keep_open: bool) -> None:
        self.search_text = query
        self.matched = matches(self.lines, query)
        self.current = None
        self._draw()
        if self.matched and keep_open:
            self.query_one(ConsoleView).go_to(self.matched[-1])  # the newest match, as you type

    # --- drawing ----------------------------------------------------------------------------
    def repaint(self, force: bool = False) -> None:
        state = self._source()
        if state is None:
            return
        log = state.console
        key = (id(log), log.revision)
        if key == self._seen and not force:
            return
        self._seen = key
        current_seq = self.lines[self.current].seq if self.current is not None else None
        self.lines = log.shown()
        self.matched = matches(self.lines, self.search_text)
        self.current = None
        if current_seq is not None:  # the match shown stays shown as lines come and go
            for i in self.matched:
                if self.lines[i].seq == current_seq:
                    self.current = i
                    break
        self._draw()
        held = len(log.lines)
        title = f"Console · {held:,} lines" if held else "Console"
        if log.missed:
            title += f" · {log.missed:,} earlier or flooded lines not kept"
        self.query_one("#console-title", Static).update(title)

    def _draw(self) -> None:
        view = self.query_one(ConsoleView)
        view.show(self.lines, self.search_text, self.matched, self.current)
        foot = self.query_one("#console-foot", Static)
        if not self.lines:
            foot.update(
                "no output yet (print()s are captured unless TDBG_CONSOLE=0; C-level writes "
                "and subprocesses need TDBG_CONSOLE=fd)"
            )
        elif self.search_text:
            where = (
                f"match {self.matched.index(self.current) + 1} of {len(self.matched)}"
                if self.current is not None and self.current in self.matched
                else f"{len(self.matched)} matching line{'' if len(self.matched) == 1 else 's'}"
            )
            foot.update(f"/{self.search_text} · {where}")
        else:
            foot.update("following the newest line" if view.follows() else "scrolled up")
