"""Deep dives in the TUI: keys send commands, jobs and results fill the panels (issue 3).

The app is the real one under its Pilot. Most tests feed it messages that follow the wire contract
(a fake Source that also records what the app sends); the last one drives a real probe in a demo
training subprocess: press p, submit the form, see the top-ops table fill.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_job import demo_job
from textual.pilot import Pilot
from textual.widgets import Input
from waiting import TIMEOUT, wait_for

from tdbg.connect.client import ProbeClient
from tdbg.model.deep import MAX_JOBS, DeepState
from tdbg.model.run_state import RunState
from tdbg.protocol import framing
from tdbg.tui.app import TdbgApp, make_app, save_screenshot, screen_text
from tdbg.tui.screens.help import INDENT, HelpScreen
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.screens.profile_form import ProfileFormScreen
from tdbg.tui.sources.base import ReplaySource, SocketSource, Source
from tdbg.tui.sources.synthetic import (
    RUN,
    activations_message,
    job_messages,
    profile_result,
    snapshot_result,
    synthetic_nan_hunt,
    synthetic_run,
)
from tdbg.tui.widgets.activation_table import ActivationTable
from tdbg.tui.widgets.deep_panel import DeepPanel
from tdbg.tui.widgets.glyphs import BLOCKS
from tdbg.tui.widgets.profiler_panel import ProfilerPanel
from tdbg.tui.widgets.profiler_table import ProfilerTable

SIZE = (120, 40)
PROFILE_ARGS = {
    "steps": 5,
    "max_seconds": 30.0,
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
}


class FeedSource(Source):
    """A live-looking source the test feeds batch by batch; records every command sent."""

    read_only_reason = None

    def __init__(self, run: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.run = dict(run or RUN)
        self.label = "feed"
        self.inbox: queue.SimpleQueue[list[dict[str, Any]]] = queue.SimpleQueue()
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.refuse_sends: str | None = None  # set: the next sends fail as a dead socket would

    def feed(self, *messages: dict[str, Any]) -> None:
        self.inbox.put(list(messages))

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        while not self.stopped:
            try:
                yield self.inbox.get(timeout=0.05)
            except queue.Empty:
                continue

    def _send(self, command: str, args: dict[str, Any]) -> int | None:
        if self.refuse_sends is not None:
            raise BrokenPipeError(self.refuse_sends)
        mid = len(self.sent) + 1
        self.sent.append((mid, command, dict(args)))
        return mid


async def shows(pilot: Pilot[Any], app: TdbgApp, *needles: str, timeout: float = TIMEOUT) -> str:
    """Wait until every needle is on screen; return the screen text."""
    await wait_for(
        pilot,
        lambda: all(n in screen_text(app) for n in needles),
        f"{needles} on screen",
        timeout,
    )
    return screen_text(app)


def notifications(app: TdbgApp) -> list[str]:
    return app.notices


async def started(pilot: Pilot[Any], app: TdbgApp, source: FeedSource) -> None:
    source.feed(*synthetic_run(steps=120, n_layers=6))
    await wait_for(pilot, lambda: app.state.synced and app.state.connection == "live", "synced")


def profile_rows(app: TdbgApp) -> list[str]:
    table = app.query_one(ProfilerTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


# --- the profile flow, fed as the wire contract spells it -------------------------------------


async def test_profile_progress_then_table_sorted_with_share_and_trace() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await shows(pilot, app, "Press p to profile")
        steps = job_messages(1, "profile", PROFILE_ARGS, profile_result((100, 104)))
        source.feed(steps[0])
        await shows(pilot, app, "profile #1: armed")
        source.feed(*steps[1:3])
        await shows(pilot, app, "profile #1: running 2/5 steps")
        panel = app.query_one(ProfilerPanel)
        assert panel.has_class("-active") and panel.has_class("-empty")
        source.feed(*steps[3:-1])
        await shows(pilot, app, "profile #1: analysing 5 steps")
        source.feed(steps[-1])
        text = await shows(pilot, app, "profile #1: done", "aten::addmm")
        assert panel.has_class("-done") and not panel.has_class("-empty")
        # Default sort: the result's own (CPU total on a CPU run), largest first.
        table = app.query_one(ProfilerTable)
        assert table.sort_key == "cpu_total" and table.descending
        result = profile_result((100, 104))
        expected = [r["name"] for r in sorted(result["rows"], key=lambda r: -r["cpu_total"])]
        assert profile_rows(app) == expected
        # Share of profiled time = self CPU / total self CPU on a CPU run.
        addmm = next(r for r in result["rows"] if r["name"] == "aten::addmm")
        share = 100 * addmm["self_cpu"] / result["total_self_cpu"]
        assert f"{share:.1f}%" in text
        assert "/tmp/tdbg-run/profile-step100.pt.trace.json (1.18 MiB)" in text
        assert "steps 100–104" in text
        assert any("profile #1 done" in n for n in notifications(app))


async def test_second_profile_is_compared_with_the_first() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        source.feed(*job_messages(1, "profile", PROFILE_ARGS, profile_result((100, 104))))
        await shows(pilot, app, "profile #1: done")
        assert "Δ/call" not in screen_text(app)  # nothing to compare with yet
        slower = profile_result((200, 204), slower={"aten::addmm": 1.6, "aten::tanh": 0.5})
        source.feed(*job_messages(2, "profile", PROFILE_ARGS, slower, start=200))
        # The table (whose header has Δ/call) and the comparison line under it are separate
        # widgets that a loaded machine may paint in separate frames: wait for both.
        text = await shows(pilot, app, "profile #2: done", "Δ/call", "prev/call", "vs profile")
        assert "vs profile #1" in text and "1 op(s) slower: aten::addmm" in text
        table = app.query_one(ProfilerTable)
        assert table.previous is not None and app.state.deep.previous_profile_job == 1
        assert table.slower_ops() == ["aten::addmm"]
        cells = {str(table.get_row_at(i)[0]): table.get_row_at(i) for i in range(table.row_count)}
        assert str(cells["aten::addmm"][-1]).startswith("+60%")
        assert str(cells["aten::tanh"][-1]).startswith("-50%")
        assert str(cells["aten::mm"][-1]).startswith("+0%")
        # Sort by the change: the op that got slower heads the table.
        for _ in range(len(table.columns_shown)):
            if table.sort_key == "delta":
                break
            await pilot.press("right_square_bracket")
        assert table.sort_key == "delta"
        await pilot.pause()
        assert profile_rows(app)[0] == "aten::addmm"
        assert profile_rows(app)[-1] == "aten::tanh"


async def test_profile_table_sorts_by_any_column() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        source.feed(*job_messages(1, "profile", PROFILE_ARGS, profile_result()))
        await shows(pilot, app, "profile #1: done")
        table = app.query_one(ProfilerTable)
        result = profile_result()
        seen = []
        for _ in range(len(table.columns_shown)):
            await pilot.press("right_square_bracket")
            key = table.sort_key
            seen.append(key)
            names = profile_rows(app)
            if key == "name":
                assert names == sorted(names)
                continue
            column = "self_cpu" if key == "share" else key
            values = [next(r for r in result["rows"] if r["name"] == n)[column] for n in names]
            assert values == sorted(values, reverse=True), key
            caption = (f"sort {key}", table.sort_caption())  # shown once Sorted is handled

            def sorted_shown(shown: tuple[str, str] = caption) -> bool:
                return any(s in screen_text(app) for s in shown)

            await wait_for(pilot, sorted_shown, key)
        assert set(seen) == set(table.columns_shown)
        # "[" goes back; a header click sorts by that column, a second click reverses it.
        await pilot.press("left_square_bracket")
        assert table.sort_key == seen[-2]
        x = 1 + sum(c.get_render_width(table) for c in table.ordered_columns[:1])
        await pilot.click(ProfilerTable, offset=(x, 0))
        await wait_for(pilot, lambda: table.sort_key == "calls", "header click sorts by calls")
        assert table.descending
        await pilot.click(ProfilerTable, offset=(x, 0))
        await wait_for(pilot, lambda: not table.descending, "second click reverses")
        calls = [
            next(r for r in result["rows"] if r["name"] == n)["calls"] for n in profile_rows(app)
        ]
        assert calls == sorted(calls)


async def test_failed_job_says_why() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        failed = job_messages(
            1, "profile", PROFILE_ARGS, None, final="failed", message="profiler already active"
        )
        source.feed(*failed)
        await shows(pilot, app, "profile #1: failed: profiler already active")
        assert app.query_one(ProfilerPanel).has_class("-failed")
        await wait_for(pilot, lambda: any("failed" in n for n in notifications(app)), "notice")


# --- keys send commands; refusals and unavailable commands are said, not crashed on ---------


async def test_keys_send_the_commands() -> None:
    run = dict(RUN, device="cpu", commands={"snapshot": "needs CUDA: this run is on cpu"})
    source = FeedSource(run)
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("n")
        await pilot.press("a")
        await pilot.press("s")
        assert [(c, a) for _, c, a in source.sent] == [
            ("nan_hunt", {"steps": 1}),
            ("anomaly", {"steps": 10}),
            ("activations", {"every": 10, "enabled": True}),
        ]
        # m on a CPU-only run says why instead of sending.
        await pilot.press("m")
        await wait_for(
            pilot,
            lambda: any("needs CUDA: this run is on cpu" in n for n in notifications(app)),
            "snapshot unavailable notice",
        )
        assert len(source.sent) == 3
        # s again once activations are on turns them off.
        source.feed(
            {"type": "ack", "id": 3, "command": "activations", "job": 3, "message": ""},
            *job_messages(3, "activations", {"every": 10, "enabled": True}, None, total=None)[:1],
        )
        source.feed({"type": "probe", "activations_every": 10, "jobs": [3]})
        await wait_for(pilot, lambda: app.state.deep.activations_on, "activations on")
        await pilot.press("s")
        assert source.sent[-1][1:] == ("activations", {"enabled": False})


def form_open(app: Any) -> bool:
    """The profile form is the screen and its fields are mounted: the screen is the app's
    as soon as it is pushed, its fields a message later (later still on a loaded machine)."""
    return isinstance(app.screen, ProfileFormScreen) and bool(app.screen.query("#profile-steps"))


async def test_profile_form_submits_validates_and_cancels() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ProfileFormScreen), "form")
        await shows(pilot, app, "Profile the next steps")
        await pilot.press("enter")  # the defaults
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "form closed")
        assert source.sent == [(1, "profile", PROFILE_ARGS)]

        await pilot.press("p")
        await wait_for(pilot, lambda: form_open(app), "form again")
        steps = app.screen.query_one("#profile-steps", Input)
        steps.value = "500"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "steps must be an integer 1-200" in screen_text(app), "why")
        assert isinstance(app.screen, ProfileFormScreen), "invalid input must not close the form"
        assert len(source.sent) == 1
        steps.value = "12"
        app.screen.query_one("#profile-seconds", Input).value = "7.5"
        await pilot.click("#profile-memory")
        await pilot.click("#profile-with-stack")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "form closed")
        assert source.sent[-1] == (
            2,
            "profile",
            dict(PROFILE_ARGS, steps=12, max_seconds=7.5, profile_memory=True, with_stack=True),
        )

        await pilot.press("p")
        await wait_for(
            pilot, lambda: isinstance(app.screen, ProfileFormScreen), "form a third time"
        )
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "escape cancels")
        assert len(source.sent) == 2


async def test_refusal_is_a_notification_and_stays_in_the_panel() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("n")
        assert source.sent == [(1, "nan_hunt", {"steps": 1})]
        source.feed(
            {"type": "error", "id": 1, "code": "BUSY", "message": "a nan_hunt is already running"}
        )
        await wait_for(
            pilot,
            lambda: any("NaN hunt refused" in n and "BUSY" in n for n in notifications(app)),
            "refusal notice",
        )
        text = await shows(pilot, app, "NaN hunt refused — BUSY: a nan_hunt is already running")
        assert app.query_one(DeepPanel).view == "deep-nan"
        assert "protocol:" not in text  # a refusal is not a protocol error
        assert app.state.errors == []


async def test_replay_is_read_only_and_a_dead_connection_only_notifies() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=50), dict(RUN), end=False))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.state.synced, "replayed")
        await pilot.press("n")
        await wait_for(
            pilot, lambda: any("read-only" in n for n in notifications(app)), "read-only notice"
        )
        assert app.is_running
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        source.refuse_sends = "Broken pipe"
        await pilot.press("a")
        await wait_for(
            pilot,
            lambda: any("could not send anomaly" in n for n in notifications(app)),
            "send failure notice",
        )
        assert app.is_running and app.state.deep.requests == {}


async def test_cancel_sends_the_active_job() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("c")
        await wait_for(pilot, lambda: any("no deep dive" in n for n in notifications(app)), "none")
        source.feed(*job_messages(7, "profile", PROFILE_ARGS, None, total=50)[:3])
        await shows(pilot, app, "profile #7: running 2/50 steps")
        await pilot.press("c")
        assert source.sent[-1][1:] == ("cancel", {"job": 7})
        cancelled = job_messages(7, "profile", PROFILE_ARGS, None, total=50, final="cancelled")
        source.feed(dict(cancelled[-1], message="cancelled by a client"))
        await shows(pilot, app, "profile #7: cancelled: cancelled by a client")


# --- the other dives' results --------------------------------------------------------------


async def test_nan_hunt_result_is_shown() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        source.feed(*job_messages(5, "nan_hunt", {"steps": 1}, synthetic_nan_hunt(), total=1))
        text = await shows(pilot, app, "first non-finite output in body.1 (Linear)")
        assert "forward at step 151" in text
        assert "12 of 4096 elements non-finite" in text
        assert "input min -3.25 max 4.5" in text and "inputs finite" in text
        assert app.query_one(DeepPanel).view == "deep-nan"
        assert any("body.1" in n for n in notifications(app))
        source.feed(
            *job_messages(
                6, "nan_hunt", {"steps": 1}, synthetic_nan_hunt(False), total=1, start=130
            )
        )
        await shows(pilot, app, "NaN hunt #6: no non-finite value in 1 step(s)")


async def test_snapshot_result_shows_file_and_top_sites() -> None:
    source = FeedSource(dict(RUN, device="cuda:0", commands={}))
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("m")
        assert source.sent == [(1, "snapshot", {})]
        source.feed(*job_messages(2, "snapshot", {"steps": 3}, snapshot_result(), total=3))
        text = await shows(pilot, app, "/tmp/tdbg-run/snapshot-step100.pickle (3.3 MiB)")
        assert "1 GiB" in text and "train.py:42 forward" in text
        assert "active 3 GiB" in text and "reserved 4 GiB" in text
        assert app.query_one(DeepPanel).view == "deep-snapshot"


async def test_anomaly_mode_warns_while_on() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("a")
        warning = "anomaly mode is global and slow: every op records a traceback while it is on"
        source.feed({"type": "ack", "id": 1, "command": "anomaly", "job": 4, "message": warning})
        anomaly = job_messages(4, "anomaly", {"steps": 10, "check_nan": False}, {"errors": 0}, 10)
        source.feed(*anomaly[:3])
        monitor = app.monitor
        await wait_for(pilot, lambda: monitor.has_class("-anomaly"), "anomaly class")
        await shows(pilot, app, "autograd anomaly mode ON", "global and slow")
        assert any("global and slow" in n for n in notifications(app))
        source.feed(*anomaly[3:])
        await wait_for(pilot, lambda: not monitor.has_class("-anomaly"), "anomaly off")
        await wait_for(
            pilot, lambda: any("is off again" in n for n in notifications(app)), "off notice"
        )
        assert "autograd anomaly mode ON" not in screen_text(app)


async def test_activation_statistics_beside_the_gradient_norms() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        assert not app.query_one("#act-panel").display
        every = {"every": 10, "enabled": True}
        source.feed(
            dict(job_messages(3, "activations", every, None, total=None)[0], state="running")
        )
        source.feed(activations_message(step=110))
        monitor = app.monitor
        await wait_for(pilot, lambda: monitor.has_class("-activations"), "activations class")
        text = await shows(pilot, app, "Activations per module", "blocks.0.fc", "|out| by decade")
        assert "Gradient norms per layer" in text  # both tables on screen at once
        table = app.query_one(ActivationTable)
        await wait_for(pilot, lambda: table.row_count == 8, "8 modules")
        assert table.row_state(3) == "dead" and table.row_state(4) == "nonfinite"
        assert table.row_state(0) is None
        row = [str(c) for c in table.get_row_at(4)]
        assert row[:2] == ["blocks.2.fc", "7"] and row[-1] == "Linear"
        assert "NaN" in row and "+inf" in row
        assert "100%" in [str(c) for c in table.get_row_at(3)]
        # The |output| distribution by decade: the dead ReLU all exact zeros, the NaN module's
        # non-finite outputs in the last glyph, a live one's bell around 0.1-1.
        column = [str(c) for c in table.get_column("distribution")]
        assert column[3] == "█" + "·" * 14
        assert column[4][-1] != "·" and column[4][0] == "·"
        assert max(column[0], key=lambda g: BLOCKS.find(g)) == column[0][9] == "█"  # 1e-1
        # Turned off: the job ends cancelled and the panel goes away.
        off = job_messages(3, "activations", every, None, total=None, final="cancelled")[-1]
        source.feed(off)
        await wait_for(pilot, lambda: not monitor.has_class("-activations"), "activations off")


async def test_narrow_terminal_still_shows_the_dives(tmp_path: Path) -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, source)
        source.feed(*job_messages(1, "profile", PROFILE_ARGS, profile_result()))
        source.feed(*job_messages(2, "profile", PROFILE_ARGS, profile_result(), start=200))
        source.feed(dict(job_messages(3, "activations", {}, None, total=None)[0], state="running"))
        source.feed(activations_message())
        text = await shows(
            pilot, app, "aten::addmm", "trace /tmp/tdbg-run", "Δ/call", "blocks.0.fc"
        )
        assert "Gradient norms" in text and "Loss" in text
        app.monitor.query_one("#profiler-panel").focus()  # z maximises the focused panel
        await pilot.press("z")  # zoom the deep-dive panel
        await wait_for(pilot, lambda: app.monitor.maximized is not None, "maximized")
        assert app.monitor.maximized is app.query_one("#profiler-panel")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.monitor.maximized is None, "restored")
        await pilot.press("z")
        await wait_for(pilot, lambda: app.monitor.maximized is not None, "maximized again")
        await pilot.press("z")
        await wait_for(pilot, lambda: app.monitor.maximized is None, "restored by z")
        await pilot.press("d")
        assert app.query_one(DeepPanel).view == "deep-snapshot"
        await shows(pilot, app, "No memory snapshot yet")
        save_screenshot(app, tmp_path / "narrow.svg")


async def test_help_lists_the_deep_dive_keys() -> None:
    source = FeedSource()
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot, app, source)
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "help")
        # The help scrolls on a short terminal: read it page by page, as a user would, each
        # page once it is on screen (a frame read too early would skip a page).
        page = await wait_for(pilot, lambda: _screen_with(app, "tdbg — keys"), "the first page")
        text = page
        for _ in range(20):
            if "escape or ? closes it" in text:
                break
            await pilot.press("pagedown")
            # The page scrolls animated: a frame read mid-scroll would skip the lines between
            # it and where the scroll ends (the next page goes on from there).
            await pilot.wait_for_scheduled_animations()

            def next_page(shown: str = page) -> str:
                return _screen_unlike(app, shown)

            page = await wait_for(pilot, next_page, "the next page")
            text += page
        for line in ("profile the next steps", "memory snapshot", "NaN hunt", "anomaly mode"):
            assert line in text
        assert "o".ljust(INDENT) + "gradient table" in text  # a key with its words beside it


def _screen_with(app: TdbgApp, needle: str) -> str:
    """The screen's text if it shows ``needle``, else ''."""
    text = screen_text(app)
    return text if needle in text else ""


def _screen_unlike(app: TdbgApp, before: str) -> str:
    """The screen's text once it is no longer ``before``, else ''."""
    text = screen_text(app)
    return text if text != before else ""


# --- RunState and DeepState, without textual ---------------------------------------------


def test_state_folds_jobs_results_and_refusals() -> None:
    state = RunState(dict(RUN))
    state.sent(1, "profile", PROFILE_ARGS)
    state.apply({"type": "ack", "id": 1, "command": "profile", "job": 9, "message": ""})
    assert state.deep.requests[1].job == 9
    state.apply_many(job_messages(9, "profile", PROFILE_ARGS, profile_result()))
    assert state.deep.profile is not None and state.deep.profile_job == 9
    assert state.deep.previous_profile is None
    state.sent(2, "profile", PROFILE_ARGS)
    state.apply({"type": "error", "id": 2, "code": "BUSY", "message": "busy"})
    assert state.deep.refusal("profile") == "BUSY: busy"
    assert state.errors == []  # a refusal is not a protocol error
    state.apply({"type": "error", "code": "BAD_FRAME", "message": "bad"})  # no id: protocol
    assert state.errors == ["BAD_FRAME: bad"]
    # A later job of the same kind supersedes the refusal.
    state.apply_many(job_messages(10, "profile", PROFILE_ARGS, profile_result(), start=200))
    assert state.deep.refusal("profile") is None
    assert state.deep.previous_profile is not None and state.deep.previous_profile_job == 9
    notices = [n.text for n in state.deep.drain_notices()]
    assert any("refused" in n for n in notices) and any("#10 done" in n for n in notices)
    assert state.deep.drain_notices() == []


def test_state_is_bounded_and_history_is_quiet() -> None:
    deep = DeepState()
    for job in range(1, 101):
        for message in job_messages(job, "profile", {}, profile_result(), history=True):
            deep.apply_job(message)
    assert len(deep.jobs) == MAX_JOBS
    assert min(deep.jobs) == 100 - MAX_JOBS + 1
    assert len(deep.profiles) == 4 and deep.profiles[-1][0] == 100
    assert deep.drain_notices() == []  # replayed history is shown, not announced
    # An active job is never dropped to make room.
    deep.apply_job(job_messages(101, "nan_hunt", {}, None, total=1)[0])
    for job in range(102, 140):
        for message in job_messages(job, "profile", {}, profile_result()):
            deep.apply_job(message)
    assert 101 in deep.jobs and deep.jobs[101].active


def test_state_ignores_unknown_and_malformed_fields() -> None:
    state = RunState(dict(RUN))
    state.apply({"type": "job", "job": "x"})  # no job number: ignored
    state.apply({"type": "job", "job": 1, "command": "profile", "state": "done", "result": []})
    state.apply({"type": "job", "job": 2, "state": "done", "args": "?", "surprise": 1})
    bad = {"rows": [{"name": "aten::mm", "calls": "many"}, "junk"], "steps": "?", "trace": 3}
    state.apply({"type": "job", "job": 3, "command": "profile", "state": "done", "result": bad})
    profile = state.deep.profile
    assert profile is not None and profile.rows[0].calls is None and profile.trace is None
    assert profile.share(profile.rows[0]) is None
    state.apply({"type": "activations", "step": 4, "names": ["a", "b"], "mean": [1.0]})
    acts = state.deep.activations
    assert acts is not None and acts.mean[0] == 1.0 and math.isnan(acts.mean[1])
    state.apply({"type": "probe", "activations_every": None, "jobs": [1, "x"], "new": True})
    assert state.deep.active_jobs == [1] and not state.deep.activations_on
    state.apply({"type": "ack", "id": 99, "job": 5})  # an ack for an id we never sent
    state.apply({"type": "something_new", "x": 1})
    hunt = {"found": True, "module": "", "module_type": "Net", "phase": "backward"}
    state.apply({"type": "job", "job": 6, "command": "nan_hunt", "state": "done", "result": hunt})
    assert state.deep.nan_hunt is not None and state.deep.nan_hunt.module_label == "(root model)"


# --- sending on a real socket ------------------------------------------------------------------


@pytest.fixture
def client_pair() -> Iterator[tuple[ProbeClient, socket.socket]]:
    ours, theirs = socket.socketpair()
    welcome = {"type": "welcome", "run": dict(RUN)}
    client = ProbeClient(ours, welcome, framing.Decoder(framing.MAX_OUTBOUND_FRAME), [])
    yield client, theirs
    with contextlib.suppress(OSError):
        theirs.close()
    client.close()


def test_socket_source_sends_from_many_threads_without_tearing_frames(
    client_pair: tuple[ProbeClient, socket.socket],
) -> None:
    client, probe_end = client_pair
    source = SocketSource(client=client)
    ids: list[int | None] = []
    received: list[dict[str, Any]] = []

    def probe_reads() -> None:  # the probe side drains its socket, as the real server does
        decoder = framing.Decoder(framing.MAX_INBOUND_FRAME, expect_preamble=False)
        probe_end.settimeout(10)
        while len(received) < 400:
            received.extend(decoder.feed(probe_end.recv(65536)))

    def sender() -> None:
        for _ in range(50):
            ids.append(source.send("nan_hunt", steps=1))

    reader = threading.Thread(target=probe_reads)
    reader.start()
    threads = [threading.Thread(target=sender) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    reader.join(TIMEOUT)
    assert sorted(i or 0 for i in ids) == list(range(1, 401))
    assert sorted(m["id"] for m in received) == list(range(1, 401))  # no frame torn or lost
    assert all(m["type"] == "nan_hunt" and m["args"] == {"steps": 1} for m in received)


def test_socket_source_send_on_a_dead_connection_returns_none(
    client_pair: tuple[ProbeClient, socket.socket],
) -> None:
    client, probe_end = client_pair
    source = SocketSource(client=client)
    probe_end.close()
    results = [source.send("anomaly", steps=10) for _ in range(3)]  # the first may still buffer
    assert results[-1] is None
    assert source.send_error is not None and "anomaly" in source.send_error
    client.close()
    assert source.send("nan_hunt") is None and "not connected" in str(source.send_error)
    assert ReplaySource([]).send("nan_hunt") is None


# --- a real probe in a real training process ---------------------------------------------------

MATMUL_OPS = ("aten::addmm", "aten::linear", "aten::mm", "aten::matmul")


async def test_live_profile_from_the_keyboard(runtime_dir: Path) -> None:
    args = ("--delay", "0.002", "--steps", "100000", "--width", "64", "--depth", "4")
    with demo_job("mlp", *args, runtime=runtime_dir) as (proc, entry):
        app = make_app(SocketSource(path=str(entry.socket)))
        async with app.run_test(size=SIZE) as pilot:
            state = app.state
            await wait_for(pilot, lambda: len(state.steps) > 10, "steps", timeout=30)
            await pilot.press("p")
            await wait_for(pilot, lambda: form_open(app), "the form")
            app.screen.query_one("#profile-steps", Input).value = "3"
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "form closed")
            await wait_for(
                pilot,
                lambda: any(r.job is not None for r in state.deep.requests.values()),
                "the probe's ack",
            )
            await wait_for(
                pilot,
                lambda: state.deep.profile is not None,
                f"a finished profile (last job: {state.deep.latest_job('profile')})",
                timeout=60,
            )
            await wait_for(pilot, lambda: app.query_one(ProfilerTable).row_count > 0, "rows")
            rows = profile_rows(app)
            assert any(op in rows for op in MATMUL_OPS), rows
            profile = state.deep.profile
            assert profile is not None and profile.trace is not None
            assert Path(profile.trace.path).is_file()
            await shows(pilot, app, f"trace {profile.trace.path}"[:60], "profile #")
            assert proc.poll() is None, "profiling must not disturb the training job"
        proc.terminate()


def test_a_hunt_that_lands_in_poisoned_weights_says_where_to_look() -> None:
    # After an optimizer step has spread a NaN into every weight, the hunt's first module is
    # merely the first layer the data meets: the view must say the damage began earlier.
    from tdbg.protocol.messages.results import NanHuntResult
    from tdbg.tui.widgets.nan_hunt_view import hunt_lines

    def hunt(params: int) -> NanHuntResult:
        result = synthetic_nan_hunt()
        result["params_nonfinite"] = params
        read = NanHuntResult.from_wire(result)
        assert read is not None
        return read

    clean = "\n".join(hunt_lines(hunt(0), 3))
    assert "parameters non-finite 0" in clean and "earlier update" not in clean
    poisoned = "\n".join(hunt_lines(hunt(16640), 3))
    assert "weights are already non-finite (16640 elements)" in poisoned
    assert "first nonfinite_grad alert" in poisoned


def test_a_hunt_without_figures_claims_none() -> None:
    # Anomaly mode names the module and phase only: no "n/a of n/a elements" beside an
    # "inputs finite" nobody measured.
    from tdbg.protocol.messages.results import NanHuntResult
    from tdbg.tui.widgets.nan_hunt_view import hunt_lines

    result = synthetic_nan_hunt()
    result.update(nonfinite=None, numel=None, input_min=None, input_max=None, params_nonfinite=None)
    read = NanHuntResult.from_wire(result)
    assert read is not None
    text = "\n".join(hunt_lines(read, 4))
    assert "first non-finite" in text and "step(s) checked" in text
    assert "n/a of" not in text and "inputs finite" not in text and "parameters" not in text
