"""The alerts panel: root cause first, repeats folded, scrolled from the keyboard, one alert in
full on enter; and the fold itself as plain Python."""

from __future__ import annotations

from collections import deque
from typing import Any

from test_tui_app import painted, shows
from test_tui_loss_chart import focus_by_tab
from textual.containers import VerticalScroll
from waiting import wait_for

from tdbg.model.alert_view import AlertDigest
from tdbg.model.run_state import Alert
from tdbg.protocol.messages import alert_message
from tdbg.tui.app import make_app, screen_text
from tdbg.tui.screens.alert_detail import AlertDetailScreen
from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import ReplaySource
from tdbg.tui.sources.synthetic import RUN, START_TIME, synthetic_run
from tdbg.tui.widgets.alert_list import AlertList


def alert(kind: str, step: int, message: str = "", severity: str = "error") -> Alert:
    return Alert(kind, severity, step, None, message or f"{kind} happened", ())


def test_first_of_each_kind_is_pinned_in_order_and_repeats_fold() -> None:
    digest = AlertDigest()
    arrived = [
        alert("nonfinite_grad", 100, "grad NaN in blocks.3"),
        *(alert("nonfinite_loss", s, "loss is NaN") for s in range(101, 131)),
        alert("loss_spike", 90 + 50, "loss jumped 4x", "warning"),
        alert("nonfinite_grad", 131, "grad NaN in blocks.0"),
        alert("nonfinite_grad", 132, "grad NaN in blocks.3"),
        alert("nonfinite_grad", 133, "grad NaN in blocks.0"),
    ]
    alerts: deque[Alert] = deque(maxlen=500)
    for a in arrived:
        alerts.appendleft(a)  # RunState keeps them newest first
    assert digest.update(alerts, len(arrived))
    pinned = [(r.alert.kind, r.first_step, r.count, r.last_step) for r in digest.pinned]
    assert pinned == [
        ("nonfinite_grad", 100, 4, 133),
        ("nonfinite_loss", 101, 30, 130),
        ("loss_spike", 140, 1, 140),
    ]
    later = [(r.alert.message, r.count, r.first_step, r.last_step) for r in digest.later]
    assert later == [("grad NaN in blocks.0", 2, 131, 133)]  # the first's own message folds in
    assert not digest.update(alerts, len(arrived))  # nothing new: nothing to redraw


def test_the_root_cause_stays_pinned_after_the_bounded_list_drops_it() -> None:
    digest = AlertDigest()
    alerts: deque[Alert] = deque(maxlen=5)
    count = 0
    for a in [alert("nonfinite_grad", 1), *(alert("nonfinite_loss", s) for s in range(2, 40))]:
        alerts.appendleft(a)
        count += 1
        if count % 3 == 0:  # read at a repaint, every few alerts
            digest.update(alerts, count)
    digest.update(alerts, count)
    assert [r.alert.kind for r in digest.pinned] == ["nonfinite_grad", "nonfinite_loss"]
    assert digest.pinned[1].count == 38 and digest.missed == 0
    late = AlertDigest()  # attached late: the bounded list already dropped the first ones
    late.update(alerts, count)
    assert late.missed == count - 5 and late.pinned[0].alert.kind == "nonfinite_loss"
    replay: deque[Alert] = deque([alert("loss_spike", 5, severity="warning")])
    assert digest.update(replay, 1)  # a new list (a replay cursor moved): start over
    assert [r.alert.kind for r in digest.rows()] == ["loss_spike"]


STALL = {
    **alert_message("stalled", "error", 290, "no step for 63 s after step 290", [], START_TIME),
    "stack": ["train.py:40 in main", "loader.py:12 in __next__"],
    "collective": {"seq": 17, "op": "allreduce", "state": "started"},
}


def alerts_run() -> list[dict[str, Any]]:
    """The synthetic run (a loss spike at step 100, a zero grad at 150), then a NaN that repeats
    for 30 steps, 30 different spikes and a stall with its stack and collective."""
    extra: list[dict[str, Any]] = [
        dict(
            alert_message(
                "nonfinite_loss", "error", s, "loss is NaN", ["blocks.0.attn.weight"], START_TIME
            )
        )
        for s in range(200, 230)
    ]
    extra += [
        dict(
            alert_message(
                "loss_spike",
                "warning",
                230 + k,
                f"loss jumped {k}.5x above its running mean",
                [],
                START_TIME,
            )
        )
        for k in range(30)
    ]
    return [*synthetic_run(steps=300, n_layers=4), *extra, STALL]


async def test_alerts_panel_root_cause_first_scrolls_and_opens_one() -> None:
    app = make_app(ReplaySource(alerts_run(), dict(RUN)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.state.alert_count == 63, "every alert")
        await painted(pilot, app)
        await shows(pilot, app, "200–229 ×30 nonfinite_lo")
        text = screen_text(app)
        order = [text.index(k) for k in ("loss_spike", "zero_grad", "nonfinite_lo", "stalled")]
        assert order == sorted(order), "the kinds in the order they first came"
        assert text.count("nonfinite_lo") == 1, "thirty repeats fold into one row"

        alerts = app.query_one(AlertList)
        await focus_by_tab(pilot, app, alerts)
        assert alerts.highlighted == 0
        oldest_spike = "230 loss_spike"  # the bottom row: later alerts are newest first
        assert oldest_spike not in screen_text(app)
        await pilot.press("end")
        await shows(pilot, app, oldest_spike)
        await pilot.press("home")
        await wait_for(pilot, lambda: oldest_spike not in screen_text(app), "back at the top")
        await pilot.press("pagedown")
        await wait_for(pilot, lambda: alerts.highlighted not in (None, 0), "pagedown moved")
        await pilot.press("pageup")
        await wait_for(pilot, lambda: alerts.highlighted == 0, "pageup back to the top")

        # The stall (4th pinned row) in full: its stack and its last collective.
        await pilot.press("down", "down", "down")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, AlertDetailScreen), "the detail")
        await shows(
            pilot,
            app,
            "no step for 63 s after step 290",
            "loader.py:12 in __next__",
            "op: allreduce",
            "seq: 17",
        )
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "back to the monitor")

        await pilot.press("up", "enter")  # the NaN row: its layers and its count
        await shows(pilot, app, "blocks.0.attn.weight", "30 times of this kind, steps 200 to 229")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "back again")


async def test_help_scrolls_from_the_keyboard_at_80x24() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=50, n_layers=4), dict(RUN)))
    async with app.run_test(size=(80, 24)) as pilot:
        await painted(pilot, app)
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
        last = "scroll this help; escape or ? closes it"
        await shows(pilot, app, "tdbg — keys")
        assert last not in screen_text(app), "the help is longer than 24 rows"
        await pilot.press("end")
        await shows(pilot, app, last)
        await pilot.press("home")
        await shows(pilot, app, "tdbg — keys")
        box = app.screen.query_one("#help-box", VerticalScroll)
        await wait_for(pilot, lambda: box.scroll_y == 0, "the top (home's scroll is animated)")
        assert box.max_scroll_y > 3
        await pilot.press("down", "down", "down")  # line by line (each an animated scroll)
        await wait_for(pilot, lambda: box.scroll_y == 3, "three lines down")
        await pilot.press("up")
        await wait_for(pilot, lambda: box.scroll_y == 2, "one line up")
        await pilot.press("pageup", "pageup", "pageup")
        await shows(pilot, app, "tdbg — keys")
        # As many pages as the help is long: the help's length is not the test's business.
        pages = -(-box.max_scroll_y // box.scrollable_content_region.height)
        await pilot.press(*["pagedown"] * pages)
        await shows(pilot, app, last)
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "the help closed")
