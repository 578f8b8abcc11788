"""The tdbg-tui app against replayed runs and a fake probe socket: panels, keys, run lifecycle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from textual.widgets import ContentSwitcher, Static
from waiting import wait_for

from tdbg.cli.launch import launch
from tdbg.protocol import framing, messages
from tdbg.tui.app import TdbgApp, make_app, save_screenshot, screen_text
from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.screens.monitor import MonitorScreen, panel_of
from tdbg.tui.screens.picker import RunPickerScreen
from tdbg.tui.screens.waiting import WaitingScreen
from tdbg.tui.sources.base import DiscoverySource, ReplaySource, SocketSource, Source
from tdbg.tui.sources.synthetic import RUN, synthetic_run
from tdbg.tui.widgets.gradient_table import GradientTable

SIZE = (120, 40)


async def painted(pilot: Pilot[Any], app: TdbgApp) -> None:
    """Wait until everything received so far is on screen."""
    await wait_for(pilot, lambda: app.painted_revision == app.state.revision, "widgets painted")
    # Widgets finish some work when the app is idle (a DataTable sizes its columns then).
    await pilot.pause()
    # The widgets are updated; on a loaded machine the compositor can still be a frame behind,
    # so also wait until the header line is actually on screen.
    await wait_for(
        pilot,
        lambda: screen_text(app).split("\n", 1)[0].strip().startswith("tdbg"),
        "the header on screen",
    )


async def ended(pilot: Pilot[Any], app: TdbgApp) -> None:
    await wait_for(pilot, lambda: app.state.connection == "ended", "the run's end")
    await painted(pilot, app)


async def shows(pilot: Pilot[Any], app: TdbgApp, *needles: str) -> str:
    """Wait until every needle is on screen; return the screen text."""
    await wait_for(pilot, lambda: all(n in screen_text(app) for n in needles), f"{needles}")
    return screen_text(app)


async def test_panels_show_the_run() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=400, n_layers=12), dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        # Each panel's words among the needles: panels repaint apart, a frame may lag one.
        text = await shows(
            pilot,
            app,
            "step 399",
            "pid 4242",
            "smoothed",
            "0.attn.weight",
            "zero_grad",
            "CPU run · no GPU",
            "Press p to profile",
            "grads every step",
        )
        assert "synthetic" in text and "testhost" in text and "pid 4242" in text
        assert "Loss" in text and "smoothed" in text
        assert "0.attn.weight" in text  # gradient table (long names are cut in the middle)
        assert "loss_spike" in text and "zero_grad" in text  # alerts
        assert "CPU run · no GPU" in text and "NVML" not in text  # memory: expected on a CPU
        assert "Press p to profile" in text
        assert "probe 0.6%" in text and "grads every step" in text
        assert "forward" in text and "backward" in text  # step anatomy


async def test_an_evaluation_shows_as_no_grad_time_not_as_an_input_bound_run() -> None:
    """A validation between two steps (forwards without grad) takes most of the recent steps'
    time: the bar names it, and the run is not called input-bound (its data wait is small)."""
    from tdbg.protocol.steps import pack_steps
    from tdbg.tui.sources.synthetic import step_records

    msgs = synthetic_run(steps=100, n_layers=4)
    tail = step_records(100, 20, 4)
    for record in tail:
        record.no_grad_time = 0.0
    tail[5].no_grad_time, tail[5].data_time, tail[5].step_time = 2.0, 0.005, 2.05
    msgs.insert(-1, pack_steps(tail, 4))
    app = make_app(ReplaySource(msgs, dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        text = await shows(pilot, app, "no-grad", "step 119")
        assert "INPUT-BOUND" not in text and "input-bound" not in text
        assert not app.state.input_bound
        share = app.state.anatomy()["no_grad_time"]
        assert share is not None and share > 0.5


async def test_the_anatomy_legend_keeps_every_phase_at_80_columns() -> None:
    """The longest legend: an input-bound run with a no-grad share, at 80x24: shorter names
    and gaps, never the last phase cut off."""
    # Every 10th step validates: ~150 ms steps (three digits), a third of them data.
    app = make_app(
        ReplaySource(synthetic_run(steps=400, data_share=0.97, eval_every=10), dict(RUN))
    )
    async with app.run_test(size=(80, 24)) as pilot:
        await ended(pilot, app)
        text = await shows(pilot, app, "INPUT-BOUND", "no-grad")
        legend = next(line for line in text.splitlines() if "INPUT-BOUND" in line)
        assert "■ opt " in legend and "%" in legend.split("■ opt ")[1], legend


async def test_run_ended_keeps_the_data() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=200), dict(RUN), batch_size=3))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        assert app.state.n_steps == 200
        monitor = app.screen
        assert isinstance(monitor, MonitorScreen) and monitor.has_class("-ended")
        await shows(pilot, app, "● run ended", "step 199", "blocks.0.attn.weight")


async def test_live_replay_stays_live() -> None:
    source = ReplaySource(synthetic_run(steps=50), dict(RUN), end=False)
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 50, "50 steps")
        await painted(pilot, app)
        assert app.state.connection == "live"
        await shows(pilot, app, "live")


async def test_a_stalled_run_says_so_in_the_header_not_live() -> None:
    """The header's verdict (issue 11): the probe's stall alert turns "live" into "stalled",
    in red, with steps/s at 0; a resumed run is live again."""
    stall = {
        "type": "alert",
        "kind": "stalled",
        "severity": "error",
        "step": 49,
        "time": 0.0,
        "message": "no step for 63 s after step 49 — stuck at loader.py:12 in __next__",
        "layers": [],
    }
    source = ReplaySource([*synthetic_run(steps=50), stall], dict(RUN), end=False)
    app = make_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.state.n_steps == 50, "50 steps")
        await shows(pilot, app, "stalled: no step for 63 s after step 49", "0.0 steps/s")
        header = app.query_one("RunHeader")
        assert header.has_class("-stalled")


async def test_keys_toggle_heatmap_log_sort_and_help() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=300, n_layers=8, nan_at=290), dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        monitor = app.screen
        assert isinstance(monitor, MonitorScreen)
        assert monitor.has_class("-diverged")
        switcher = app.query_one("#grad-switcher", ContentSwitcher)
        assert switcher.current == "grad-table"
        await pilot.press("h")
        assert switcher.current == "grad-heatmap"
        await shows(pilot, app, "NaN/Inf", "×")  # the NaN gradient of layer 0 stands out
        await pilot.press("h")
        assert switcher.current == "grad-table"

        assert not monitor.log_scale
        await pilot.press("l")
        assert monitor.log_scale
        await shows(pilot, app, "log (l)")

        table = app.query_one(GradientTable)
        await pilot.press("o")  # s toggles activation statistics since the deep dives
        assert table.sort_mode == "norm"
        # Non-finite norms sort first: the NaN layer heads the table.
        await wait_for(
            pilot,
            lambda: str(table.get_row_at(0)[0]) == "netG blocks.0.attn.weight",
            "the NaN layer at the top of the table",
        )
        await pilot.press("o")
        assert table.sort_mode == "trend"
        await pilot.press("o")
        assert table.sort_mode == "name"

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await shows(pilot, app, "tdbg — keys", "heatmap")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, MonitorScreen), "help closed")


async def test_tab_cycles_panels() -> None:
    app = make_app(ReplaySource(synthetic_run(steps=20), dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        seen = set()
        for _ in range(9):
            await pilot.press("tab")
            focused = app.focused
            assert focused is not None
            # The panel, or the widget with keys of its own that took the panel's tab stop.
            panel = panel_of(focused)
            seen.add(panel.id if panel is not None else focused.id)
        assert {"loss-panel", "grad-panel", "memory-panel", "alerts-panel", "metrics-panel"} <= seen


async def test_a_thousand_layers_keep_up() -> None:
    messages = synthetic_run(steps=300, n_layers=1000, batch=10)
    app = make_app(ReplaySource(messages, dict(RUN), batch_size=2))
    async with app.run_test(size=SIZE) as pilot:
        # A ceiling for a loaded CI machine; alone this takes a few seconds.
        await wait_for(pilot, lambda: app.state.connection == "ended", "the run's end", 90)
        await painted(pilot, app)
        assert app.state.n_steps == 300
        table = app.query_one(GradientTable)
        await wait_for(pilot, lambda: table.row_count == 1000, "1000 rows")
        await pilot.press("h")
        await shows(pilot, app, "heatmap")


class RestartingSource(Source):
    """Two runs of the same name, one after the other, as a restarted job would look."""

    def __init__(self) -> None:
        super().__init__()
        self.run, self.messages = dict(RUN), synthetic_run(steps=100)
        self.next = [(dict(RUN, pid=5555), synthetic_run(steps=30))]

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        self.end_reason = None
        yield self.messages
        self.end_reason = "shutdown"

    def reattach(self, notify: Any) -> bool:
        if not self.next:
            return False
        self.run, self.messages = self.next.pop(0)
        return True


async def test_restarted_run_replaces_the_data() -> None:
    app = make_app(RestartingSource())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.state.run.get("pid") == 5555, "the second run")
        await ended(pilot, app)
        assert app.state.n_steps == 30
        await shows(pilot, app, "pid 5555")


# --- a fake probe on a real Unix socket ------------------------------------------------------


def serve_once(
    path: str, messages: list[dict[str, Any]], garbage: bool = False, accepts: int = 1
) -> threading.Thread:
    """A fake probe that serves ``messages`` to ``accepts`` clients, one after the other."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def run() -> None:
        for _ in range(accepts):
            serve(*server.accept())
        server.close()

    def serve(conn: socket.socket, _: Any) -> None:
        with conn:
            if garbage:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                return
            decoder = framing.Decoder(framing.MAX_INBOUND_FRAME)
            while not decoder.feed(conn.recv(65536)):
                pass
            welcome = {
                "type": "welcome",
                "proto": 1,
                "server_version": "test",
                "run": dict(RUN, socket=path),
            }
            out = framing.preamble() + framing.pack(welcome)
            for message in messages:
                out += framing.pack(message)
            # The app may already have hung up (the picker test leaves runs unattached).
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.sendall(out + framing.pack({"type": "bye", "reason": "shutdown"}))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Short base directory: sun_path is ~100 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        os.chmod(directory, 0o700)
        yield os.path.join(directory, "0-1")


async def test_socket_source_against_a_fake_probe(sock_path: str) -> None:
    thread = serve_once(sock_path, synthetic_run(steps=120, n_layers=5))
    app = make_app(SocketSource(sock_path))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        assert app.state.n_steps == 120
        assert app.state.end_reason == "shutdown; watching for a restart"
        await shows(
            pilot, app, "run ended: clean shutdown · watching for a restart", "blocks.0.attn.weight"
        )
        app.source.stop()  # no restart will come: stop watching discovery
    thread.join(5)


def test_launch_reports_a_missing_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch("/nonexistent/tdbg.sock") == 2
    err = capsys.readouterr().err
    assert err.startswith("tdbg-tui: error: ") and err.count("\n") == 1


def test_launch_reports_a_socket_that_is_not_tdbg(
    sock_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    thread = serve_once(sock_path, [], garbage=True)
    assert launch(sock_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("tdbg-tui: error: ") and "not a tdbg probe" in err
    thread.join(5)


def test_launch_reports_a_bad_metadata_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = tmp_path / "run.json"
    meta.write_text("{not json")
    assert launch(str(meta)) == 2
    assert capsys.readouterr().err.startswith("tdbg-tui: error: ")


async def test_screenshot_is_svg(tmp_path: Path) -> None:
    app = make_app(ReplaySource(synthetic_run(steps=100, gpu=True), dict(RUN)))
    async with app.run_test(size=SIZE) as pilot:
        await ended(pilot, app)
        path = save_screenshot(app, tmp_path / "tdbg.svg")
    assert Path(path).read_text().lstrip().startswith("<svg")


def write_meta(directory: str, sock: str, name: str, start: float) -> None:
    meta = dict(RUN, name=name, pid=os.getpid(), socket=sock, start_time=start)
    Path(directory, os.path.basename(sock) + ".json").write_text(json.dumps(meta))


async def test_discovery_waits_then_attaches() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        os.chmod(directory, 0o700)
        app = make_app(DiscoverySource(Path(directory)))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WaitingScreen), "waiting screen")
            await shows(pilot, app, "Waiting for a training run")
            sock = os.path.join(directory, "0-1")
            thread = serve_once(sock, synthetic_run(steps=60))
            write_meta(directory, sock, "late", 1.0)
            await ended(pilot, app)
            assert isinstance(app.screen, MonitorScreen)
            assert app.state.n_steps == 60
            app.source.stop()
        thread.join(5)


async def test_several_runs_open_the_picker() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        os.chmod(directory, 0o700)
        threads = []
        for i, steps in enumerate((40, 70)):
            sock = os.path.join(directory, f"0-{i}")
            # Two clients each: the picker's peek at its row, then the app if it is picked.
            threads.append(serve_once(sock, synthetic_run(steps=steps), accepts=2))
            write_meta(directory, sock, f"run{i}", float(i))
        app = make_app(DiscoverySource(Path(directory)))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, RunPickerScreen), "the picker")
            await shows(pilot, app, "run0", "run1", "step 39", "step 69")
            await pilot.press("down", "enter")
            await ended(pilot, app)
            assert app.state.n_steps == 70
            app.source.stop()
        # The run not picked is still waiting in accept(): connect once so its thread ends.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(os.path.join(directory, "0-0"))
            s.sendall(messages.hello("test"))
        for thread in threads:
            thread.join(5)


class Cells(App[None]):
    """Known text at known places: a margin, a wide character, a style change mid-line."""

    CSS = "Static { margin-left: 3; height: 1; }"

    def compose(self) -> ComposeResult:
        yield Static("日本 [bold]ab[/]  c")
        yield Static("[reverse]x[/]  é")


async def test_screen_text_is_the_screen_cell_by_cell() -> None:
    app = Cells()
    async with app.run_test(size=(16, 3)) as pilot:
        await pilot.pause()
        lines = screen_text(app).split("\n")
    # 16 cells a line: the wide characters take two each.
    assert lines == ["   日本 ab  c" + " " * 3, "   x  é" + " " * 9, " " * 16]
