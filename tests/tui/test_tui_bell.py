"""The bell on the first alert of each kind: rung once per kind as alerts arrive, never for the
alerts a late viewer is replayed, off with TDBG_BELL=0; the desktop notification's sequence."""

from __future__ import annotations

import pytest
from test_tui_deep import FeedSource
from waiting import wait_for

from tdbg.protocol.messages.alert import Alert
from tdbg.protocol.steps import StepRecord, pack_steps
from tdbg.tui.app import make_app
from tdbg.tui.ringer import AlertRinger, notification_kind


def alert(kind: str, step: int, severity: str = "error", history: bool = False) -> dict:
    message = Alert(kind, severity, step, 1.0, f"{kind} at step {step}", (), history)
    return message.to_wire()


async def test_each_kind_rings_once_and_history_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDBG_BELL", raising=False)
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=(120, 40)) as pilot:
        steps = pack_steps([StepRecord(step=i, time=1.0 + i, loss=1.0) for i in range(3)], 0)
        # A spike from before this viewer attached, replayed with the history; then live.
        source.feed(steps, alert("loss_spike", 3, "warning", history=True), {"type": "synced"})
        await wait_for(pilot, lambda: app.state.synced, "synced")
        source.feed(alert("nonfinite_loss", 121), alert("nonfinite_loss", 122))
        source.feed(alert("resumed", 123, "info"), alert("stalled", 124))
        await wait_for(pilot, lambda: app.state.alert_count == 5, "the alerts folded")
        await wait_for(pilot, lambda: len(app.rings) == 2, "rung")
        source.feed(alert("nonfinite_loss", 130), alert("loss_spike", 131, "warning"))
        await wait_for(pilot, lambda: app.state.alert_count == 7, "more alerts")
        await wait_for(pilot, lambda: len(app.rings) == 3, "rung again")
        await pilot.pause()
    # The spike replayed from before this viewer attached did not ring; its live one did.
    assert app.rings == ["nonfinite_loss", "stalled", "loss_spike"]


def test_off_and_the_desktop_notification_by_terminal() -> None:
    quiet = AlertRinger({"TDBG_BELL": "0"})
    nan = Alert("nonfinite_loss", "error", 5, 1.0, "loss is nan; at step\x075")
    assert quiet.sequence(nan, "run") == ""
    assert AlertRinger({}).sequence(nan, "run") == "\x07"
    iterm = AlertRinger({"TERM_PROGRAM": "iTerm.app"}).sequence(nan, "gpt")
    assert iterm.startswith("\x1b]9;tdbg · gpt: nonfinite_loss: loss is nan, at step 5")
    assert iterm.count("\x07") == 2  # the notification's end, then the bell: no early end
    assert notification_kind({"TERM": "rxvt-unicode"}) == "osc777"
    assert notification_kind({"TERM_PROGRAM": "WezTerm", "TMUX": "/tmp/x"}) is None
    assert notification_kind({"TDBG_NOTIFY": "osc9"}) == "osc9"
