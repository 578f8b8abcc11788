"""set_border repaints the border row its text is on, not the panel, and the screen shows it."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widgets import Static
from waiting import wait_for

from tdbg.tui.widgets.steady import set_border


class _Boxed(App[None]):
    CSS = "#box { border: round white; height: 8; width: 30; padding: 0 1; }"

    def compose(self) -> ComposeResult:
        yield Static("inside", id="box")


async def test_a_new_subtitle_repaints_the_bottom_row_alone() -> None:
    app = _Boxed()
    async with app.run_test(size=(40, 12)) as pilot:
        box = app.query_one("#box", Static)
        set_border(box, title="first", subtitle="step 1")
        await wait_for(pilot, lambda: "step 1" in _screen(app), "the first subtitle")
        box._exchange_repaint_regions()  # what the last frame drew
        set_border(box, subtitle="step 2")
        set_border(box, title="second")
        assert set(box._exchange_repaint_regions()) == {Region(0, 7, 30, 1), Region(0, 0, 30, 1)}
        await wait_for(pilot, lambda: "step 2" in _screen(app), "the new subtitle on screen")
        assert "second" in _screen(app) and "inside" in _screen(app)
        assert box.border_subtitle == "step 2" and box.border_title == "second"
        # Unchanged text: nothing repainted.
        set_border(box, title="second", subtitle="step 2")
        assert not box._exchange_repaint_regions()


def _screen(app: App[None]) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())
