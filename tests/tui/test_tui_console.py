"""The console screen: j opens the run's stdout and stderr, / searches with the matches
highlighted, n / N move between them, the tail is followed unless the user scrolled up."""

from __future__ import annotations

from test_tui_app import painted, shows
from waiting import wait_for

from tdbg.protocol.messages.console import STDERR, STDOUT, ConsoleLines
from tdbg.tui.app import make_app
from tdbg.tui.screens.console import ConsoleScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.console_view import ConsoleView


def _console(first: int, n: int, step: int) -> dict[str, object]:
    texts = tuple(
        f"\x1b[32mepoch {i // 100} batch {i % 100}\x1b[0m" if i % 50 else f"WARNING at {i}"
        for i in range(first, first + n)
    )
    streams = tuple(STDERR if t.startswith("WARNING") else STDOUT for t in texts)
    return ConsoleLines(first, streams, texts, ((STDERR, "train  40%|####"),), step).to_wire()


async def test_j_shows_the_lines_and_search_finds_and_highlights() -> None:
    messages = [*synthetic_run(steps=20, n_layers=2), _console(0, 300, 19)]
    app = make_app(ReplaySource(messages, dict(RUN)))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.state.console.next_seq == 300, "lines read")
        await painted(pilot, app)
        await pilot.press("j")
        await wait_for(pilot, lambda: isinstance(app.screen, ConsoleScreen), "the screen")
        # The tail is followed: the newest lines and the progress bar's last state are shown,
        # escape codes are not printed.
        text = await shows(pilot, app, "epoch 2 batch 99", "train  40%|####")
        assert "\x1b" not in text and "[32m" not in text and "300 lines" in text
        screen = app.screen
        assert isinstance(screen, ConsoleScreen)
        await pilot.press("slash")
        for key in "warning":
            await pilot.press(key)
        await shows(pilot, app, "6 matching lines")
        await pilot.press("enter")
        # Scrolled to it: the line under the view says so at once, the view scrolls after the
        # next refresh.
        await shows(pilot, app, "match 1 of 6", "WARNING at 0")
        view = screen.query_one(ConsoleView)
        first = screen.lines[screen.matched[0]]
        assert first.text == "WARNING at 0" and first.stderr
        # The match is drawn in the current-match style; another match in the match style.
        current = view.get_component_rich_style("console-view--current")
        strip = view.render_line(screen.matched[0] - view.scroll_offset.y)
        assert any(seg.style == current and "WARNING" in seg.text for seg in strip)
        await pilot.press("n")
        await shows(pilot, app, "match 2 of 6", "WARNING at 50")
        await pilot.press("N", "N")
        await shows(pilot, app, "match 6 of 6", "WARNING at 250")
        await pilot.press("escape")  # clears the search
        await wait_for(pilot, lambda: not screen.search_text, "search cleared")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConsoleScreen), "back")


async def test_the_tail_is_followed_unless_scrolled_up() -> None:
    source = ReplaySource([*synthetic_run(steps=5, n_layers=2), _console(0, 100, 4)], dict(RUN))
    app = make_app(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.state.console.next_seq == 100, "lines read")
        await pilot.press("j")
        await shows(pilot, app, "epoch 0 batch 99", "following the newest line")
        app.state.apply(_console(100, 20, 5))
        await shows(pilot, app, "epoch 1 batch 19")
        await pilot.press("home")
        await shows(pilot, app, "WARNING at 0")
        app.state.apply(_console(120, 20, 6))
        text = await shows(pilot, app, "140 lines", "scrolled up")
        assert "epoch 1 batch 39" not in text


async def test_without_output_it_says_why() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=10, n_layers=2), dict(RUN)))
    async with app.run_test(size=(80, 24)) as pilot:
        await painted(pilot, app)
        await pilot.press("j")
        # What the default captures and what needs the opt-in, said where it is missed.
        text = await shows(pilot, app, "no output yet", "TDBG_CONSOLE=fd", "TDBG_CONSOLE=0")
        assert text.count("\n") <= 24
