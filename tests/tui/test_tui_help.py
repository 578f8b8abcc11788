"""The help is built once and shown again; the panels under it are not painted while it shows."""

from __future__ import annotations

from test_tui_deep import FeedSource, started
from textual.containers import VerticalScroll
from waiting import wait_for

from tdbg.protocol.messages import alert_message
from tdbg.tui.app import make_app
from tdbg.tui.screens.help import HelpScreen
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
