"""The help is built once and shown again; the panels under it are not painted while it shows."""

from __future__ import annotations

import io

import pytest
from rich.cells import cell_len
from rich.console import Console
from test_tui_deep import FeedSource, started
from textual.containers import VerticalScroll
from textual.widgets import Static
from waiting import wait_for

from tdbg.protocol.messages import alert_message
from tdbg.tui.app import make_app
from tdbg.tui.screens.help import INDENT, KEYS, MIN_TEXT, HelpScreen, KeyHelp, help_blocks
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.synthetic import START_TIME

SIZE = (80, 24)  # the help is longer than the screen: it scrolls


async def test_help_is_kept_and_the_monitor_waits_under_it() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await wait_for(pilot, lambda: app.painted_revision == app.state.revision, "painted")
        monitor = app.monitor
        repaints: list[bool] = []
        rings: list[bool] = []
        real_repaint, real_ring = monitor.repaint, app._ring

        def counted_repaint(force: bool = False, clock_only: bool = False) -> bool:
            repaints.append(clock_only)
            return real_repaint(force=force, clock_only=clock_only)

        def counted_ring() -> None:
            rings.append(True)
            real_ring()

        monitor.repaint = counted_repaint  # type: ignore[method-assign]
        app._ring = counted_ring  # type: ignore[method-assign]

        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
        first = app.screen
        box = first.query_one("#help-box", VerticalScroll)
        await pilot.press("end")
        await wait_for(pilot, lambda: box.scroll_y == box.max_scroll_y > 0, "the help's end")
        repaints.clear()
        source.feed(alert_message("stalled", "error", 119, "no step for 63 s", [], START_TIME))
        revision = app.state.revision
        await wait_for(pilot, lambda: app.state.revision > revision, "the alert received")
        rings.clear()
        # Two repaint ticks after it came: each rang (the bell's check) and painted nothing.
        await wait_for(pilot, lambda: len(rings) >= 2, "two repaint ticks under the help")
        assert repaints == []
        assert app.painted_revision < app.state.revision

        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the monitor")
        await wait_for(pilot, lambda: app.painted_revision == app.state.revision, "caught up")
        assert repaints

        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help again")
        assert app.screen is first  # the same screen, not built again
        await wait_for(pilot, lambda: box.scroll_y == 0, "opened at its top")


def rendered_help(width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(KeyHelp(KEYS))
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [200, 76, 56, 38, 20])
def test_the_keys_rewrap_to_any_width_beside_their_keys(width: int) -> None:
    """A description keeps to the right of its key at any width (at 80 columns the help's own
    line breaks used to wrap to the left edge, under the keys); narrower than a key column and
    MIN_TEXT, each key goes on a line of its own with its description indented under it."""
    lines = rendered_help(width)
    assert all(cell_len(line) <= width for line in lines)
    assert all(line == line.rstrip() for line in lines)
    entries = [b for b in help_blocks(KEYS) if isinstance(b, tuple)]
    assert len(entries) > 40
    keys = [key for key, _ in entries]
    beside = width - INDENT >= MIN_TEXT
    if width >= 56:
        # Only the spaces moved: every word of KEYS is there, in order (narrower, a path longer
        # than the column is folded).
        assert " ".join(lines).split() == KEYS.split()
    for line in lines:
        if beside and line.startswith(" "):
            # A description's later line: to the right of the key column, after a key's line.
            assert line.startswith(" " * INDENT) and line[INDENT] != " ", line
        if beside and any(line.startswith(key.ljust(INDENT)) for key in keys):
            assert line[INDENT] != " "
    if not beside:
        assert any(line == "q" for line in lines) and "  quit" in lines


def test_the_help_keeps_a_key_beside_its_words_at_80_columns() -> None:
    """The help's KEYS text says which lines go on with a description (a key column of blanks)
    and which are paragraphs: both kinds are read as such."""
    blocks = help_blocks(KEYS)
    by_key = {b[0]: b[1] for b in blocks if isinstance(b, tuple)}
    assert by_key["b"].endswith("b again: clear it")  # two lines of KEYS, one description
    assert any(isinstance(b, str) and b.startswith("Alerts (tab to them)") for b in blocks)
    assert by_key["enter"]  # the alerts' keys are entries, not part of their paragraph
    lines = rendered_help(76)  # the help box's text at 80 columns
    at = lines.index(next(line for line in lines if line.startswith("b ")))
    assert lines[at + 1].startswith(" " * INDENT)


async def test_the_help_on_an_80_column_screen_has_no_line_under_the_keys() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
        keys = app.screen.query_one("#help-keys", Static)
        await wait_for(pilot, lambda: keys.size.width > 0, "the help laid out")
        drawn = [strip.text.rstrip() for strip in keys.render_lines(keys.region.reset_offset)]
        assert len(drawn) > 40
        starts = [line for line in drawn if line and not line.startswith(" ")]
        # At the left edge only keys and paragraphs' lines, never a description's later line.
        later_lines = ("health)", "or a path", "again: clear it")
        assert not any(line.startswith(later_lines) for line in starts)
        assert any(line.startswith("r") and "switch run" in line for line in starts)
