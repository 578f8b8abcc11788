"""ConsoleView: the run's console lines, drawn line by line, matches of a search highlighted."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tdbg.model.console_log import ConsoleLine, coloured

CACHE_LINES = 512  # rendered lines kept: a screenful many times over, never the whole log
ERR_MARK = "▌"  # in the stderr style: a stderr line (where stdout and stderr went apart)


class ConsoleView(ScrollView, can_focus=True):
    """Draws only the visible lines (the line API): 5,000 lines cost what a screenful does.
    Follows the tail while scrolled to the bottom; a user who scrolled up stays where they are.
    Colours the run printed (SGR escapes) are kept; other escape sequences are not obeyed."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "scroll_up", "Up", show=False),
        Binding("down", "scroll_down", "Down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "scroll_home", "Top", show=False),
        Binding("end", "scroll_end", "Bottom", show=False),
        Binding("left", "scroll_left", "Left", show=False),
        Binding("right", "scroll_right", "Right", show=False),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "console-view--stderr",
        "console-view--match",
        "console-view--current",
    }
    DEFAULT_CSS = """
    ConsoleView { height: 1fr; }
    ConsoleView > .console-view--stderr { color: $error; }
    ConsoleView > .console-view--match { background: $warning 40%; }
    ConsoleView > .console-view--current { background: $warning; color: $background; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.shown_lines: list[ConsoleLine] = []
        self.pattern = ""
        self.matched: set[int] = set()
        self.current: int | None = None  # the match n / N moved to
        self.following = True  # at the bottom: new lines scroll into view
        self._cache: OrderedDict[tuple[int, int, bool, str], Strip] = OrderedDict()

    def show(
        self,
        lines: list[ConsoleLine],
        query: str = "",
        matched: list[int] | None = None,
        current: int | None = None,
    ) -> None:
        """New lines (and the search's matches): the view keeps following the tail if it was
        at the bottom."""
        if query != self.pattern or current != self.current:
            self._cache.clear()
        self.shown_lines = lines
        self.pattern = query
        self.matched = set(matched or ())
        self.current = current
        width = max((len(line.text) for line in lines[-CACHE_LINES:]), default=0) + 2
        self.virtual_size = Size(max(width, self.size.width), len(lines))
        if self.following and current is None:
            self.scroll_end(animate=False)  # after the layout has the new size
        self.refresh()

    def follows(self) -> bool:
        return self.following

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self.following = round(new_value) >= self.max_scroll_y

    def go_to(self, index: int) -> None:
        """Scroll so that line ``index`` is in view, a few lines below the top."""
        self.scroll_to(y=max(0, index - 3), animate=False)

    def render_line(self, y: int) -> Strip:
        index = self.scroll_offset.y + y
        width = self.size.width
        if not 0 <= index < len(self.shown_lines):
            return Strip.blank(width, self.rich_style)
        line = self.shown_lines[index]
        key = (line.seq, index, index == self.current, self.pattern)
        strip = self._cache.get(key)
        if strip is None:
            strip = self._line_strip(line, index)
            self._cache[key] = strip
            if len(self._cache) > CACHE_LINES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        x = self.scroll_offset.x
        return strip.crop(x, x + width).extend_cell_length(width, self.rich_style)

    def _line_strip(self, line: ConsoleLine, index: int) -> Strip:
        text = Text.from_ansi(coloured(line.text), no_wrap=True, end="")
        text.stylize(self.rich_style, 0)
        if line.stderr:
            mark = Text(ERR_MARK, style=self.get_component_rich_style("console-view--stderr"))
            text = Text.assemble(mark, text)
        else:
            text = Text.assemble(" ", text)
        if self.pattern and index in self.matched:
            name = "console-view--current" if index == self.current else "console-view--match"
            style = self.get_component_rich_style(name)
            plain = text.plain
            query = self.pattern if self.pattern != self.pattern.lower() else self.pattern.lower()
            haystack = plain if self.pattern != self.pattern.lower() else plain.lower()
            start = haystack.find(query, 1)
            while start >= 0 and query:
                text.stylize(style, start, start + len(query))
                start = haystack.find(query, start + len(query))
        return Strip(list(text.render(self.app.console)), text.cell_len)
