"""The tdbg-tui App: ``make_app(source)`` wires a source to RunState and the monitor screen."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from rich.cells import cell_len
from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.worker import get_current_worker

from tdbg.connect.client import ConnectError
from tdbg.connect.runtime import RunEntry, discover, runtime_dir
from tdbg.model.run_state import RunState
from tdbg.tui.base_app import TdbgBaseApp
from tdbg.tui.palette import palette_commands
from tdbg.tui.ringer import AlertRinger
from tdbg.tui.screens.compare_picker import (
    ClearCompareScreen,
    ComparePickerScreen,
    nearby_recordings,
    search_directories,
)
from tdbg.tui.screens.help import HelpScreen
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.screens.picker import RunPickerScreen
from tdbg.tui.screens.waiting import WaitingScreen
from tdbg.tui.sources.base import (
    DiscoverySource,
    ReplaySource,
    SocketSource,
    Source,
    SourceMessage,
)

# Seconds: new data repaints the view at most this often, and only on change. A key repaints
# at once; 4 Hz is as fresh as a person reads a training run and halves the frames of 8 Hz.
REPAINT_INTERVAL = 1 / 4
CLOCK_INTERVAL = 1.0  # repaint at least this often anyway, so the elapsed clock ticks

__all__ = [
    "DiscoverySource",
    "ReplaySource",
    "SocketSource",
    "TdbgApp",
    "make_app",
    "save_screenshot",
    "screen_text",
]


class TdbgApp(TdbgBaseApp):
    """The monitor. All I/O happens in one thread worker; handlers only fold batches into state."""

    BINDINGS = [
        *TdbgBaseApp.BINDINGS,
        Binding("r", "switch_run", "Switch run"),
        Binding("b", "compare_recording", "Compare"),
    ]
    source: Source

    # What the reading worker posts (each carries its ``origin``: see SourceMessage). What a
    # source itself has to say (a wait, a choice, a warning) are Source's own messages.

    class EventsReceived(SourceMessage):
        """A batch of protocol messages arrived (one post per socket read, not per sample)."""

        def __init__(self, batch: list[dict[str, Any]]) -> None:
            super().__init__()
            self.batch = batch

    class ProbeConnected(SourceMessage):
        def __init__(self, run: dict[str, Any], restarted: bool) -> None:
            super().__init__()
            self.run = run
            self.restarted = restarted

    class ConnectionEnded(SourceMessage):
        def __init__(self, reason: str | None) -> None:
            super().__init__()
            self.reason = reason

    class SourceFailed(SourceMessage):
        def __init__(self, reason: str) -> None:
            super().__init__()
            self.reason = reason

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source
        self.state = RunState(source.run)
        self._painted = -1
        self._painted_at = 0.0
        self._shown_data = False  # the source's first batch has been painted (or asked to be)
        self.batches_applied = 0  # for tests and benchmarks: batches folded into the state
        # Every notification shown, oldest first: what the user was told, for tests and for
        # anyone who missed a toast.
        self.notices: list[str] = []
        self.baselines: list[tuple[str, RunState]] = []
        self.rings: list[str] = []  # the alert kinds rung for, in order (tests read it)
        self.ringer = AlertRinger()  # the bell on the first alert of each kind (TDBG_BELL=0: off)

    def get_default_screen(self) -> Screen[Any]:
        return MonitorScreen(id="monitor")

    @property
    def monitor(self) -> MonitorScreen:
        screen = self.screen_stack[0]  # the default screen sits at the bottom of the stack
        assert isinstance(screen, MonitorScreen)
        return screen

    def compare_with(self, baselines: list[tuple[str, RunState]]) -> None:
        """Other runs (recordings loaded into the model) to draw under this one's loss, each
        named in the legend; set before the app runs."""
        self.baselines = list(baselines)

    def on_mount(self) -> None:
        self.monitor.baselines = self.baselines  # the same list: what changes it, changes both
        # What the run sent on attaching, painted right after the first frame (the panels
        # have their sizes then), not after the reader's thread has started and posted it.
        first = self.source.arrived()
        if first:
            self._apply_batch(first)
        self.monitor.show(self.state)
        self.set_interval(REPAINT_INTERVAL, self._repaint)
        self.start_reading()

    def palette_changed(self) -> None:
        """Colours drawn outside the stylesheet (the NaN mark, the heatmap's scale) anew."""
        self.monitor.repaint(force=True)

    def start_reading(self) -> None:
        """Start reading the source in a worker; an app whose state is loaded up front (a
        replay) overrides this to read nothing."""
        self._pump()

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None:
        """Textual's notify (thread-safe, as Textual's is), remembered in ``notices``."""
        self.notices.append(str(message))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    # --- the worker: all blocking I/O lives here -------------------------------------------

    @work(thread=True, exclusive=True, group="source")
    def _pump(self) -> None:
        worker = get_current_worker()
        source = self.source

        def post(message: SourceMessage) -> None:
            message.origin = source
            self.post_message(message)

        try:
            source.open(post)
        except ConnectError as exc:
            if not source.stopped:
                post(self.SourceFailed(str(exc)))
            return
        restarted = False
        while not worker.is_cancelled and not source.stopped:
            post(self.ProbeConnected(dict(source.run), restarted))
            for batch in source.batches():
                post(self.EventsReceived(batch))
            post(self.ConnectionEnded(source.end_reason))
            if worker.is_cancelled or not source.reattach(post):
                return
            restarted = True

    # --- handlers: O(batch) state updates, no I/O ------------------------------------------

    def _stale(self, event: SourceMessage) -> bool:
        """The event came from a source this app has switched away from: drop it."""
        if event.origin is not None and event.origin is not self.source:
            event.stop()
            return True
        return False

    def _apply_batch(self, batch: list[dict[str, Any]]) -> None:
        self.state.apply_many(batch)
        self.batches_applied += 1
        if not self._shown_data:  # the first data: on screen now, not at the next 4 Hz tick
            self._shown_data = True
            self.call_after_refresh(self._repaint)

    def on_tdbg_app_events_received(self, event: EventsReceived) -> None:
        if self._stale(event):
            return
        self._apply_batch(event.batch)
        for notice in self.state.deep.drain_notices():
            severity: SeverityLevel = "information"
            if notice.severity in ("warning", "error"):
                severity = "warning" if notice.severity == "warning" else "error"
            self.notify(notice.text, severity=severity, timeout=8 if severity == "error" else 5)

    # --- commands: the UI thread sends, the worker keeps reading the same socket -------------

    def send_command(self, command: str, **args: Any) -> int | None:
        """Send a deep-dive command; its id, or None after telling the user why not."""
        mid = self.source.send(command, **args)
        if mid is None:
            why = self.source.send_error or f"{command} could not be sent"
            self.notify(why, severity="warning", timeout=6)
            return None
        self.state.sent(mid, command, args)
        return mid

    def on_tdbg_app_probe_connected(self, event: ProbeConnected) -> None:
        if self._stale(event):
            return
        if event.restarted:
            old = self.state.run
            same = all(event.run.get(k) == old.get(k) for k in ("pid", "start_time", "host"))
            # A restarted run replaces the data: its steps start over. Reattached to the same
            # run (a dropped ssh), the probe replays its whole history: start empty as well,
            # so the gap is refilled and nothing is counted twice.
            self.state = RunState(event.run)
            self.ringer = AlertRinger()  # a restarted run's first alerts are news again
            self.monitor.show(self.state)
            if same:
                self.notify(f"reconnected to run {event.run.get('name')}: history restored")
            else:
                self.notify(
                    f"run {event.run.get('name')} restarted (pid {event.run.get('pid')}): "
                    "showing the new run",
                    timeout=6,
                )
        else:
            self.state.run = dict(event.run) or self.state.run
        self.state.mark("live")
        while len(self.screen_stack) > 1 and isinstance(
            self.screen, WaitingScreen | RunPickerScreen
        ):
            self.pop_screen()

    def on_tdbg_app_connection_ended(self, event: ConnectionEnded) -> None:
        if self._stale(event):
            return
        reason = event.reason or "closed"
        if self.source.watches_for_restart and not self.source.stopped:
            reason += "; watching for a restart"
        self.state.mark("ended", reason)

    # --- what the source says while it attaches: one handler per message type ----------------

    def on_source_wait_started(self, event: Source.WaitStarted) -> None:
        if self._stale(event):
            return
        self.state.mark("waiting")
        if not isinstance(self.screen, WaitingScreen):
            self.push_screen(WaitingScreen(event.where))

    def on_source_runs_offered(self, event: Source.RunsOffered) -> None:
        if self._stale(event):
            return

        def chosen(entry: RunEntry | None) -> None:
            self.source.choose(entry)
            if entry is None:
                self.exit(0)

        local = isinstance(self.source, DiscoverySource)  # a remote run's socket is not here
        self.push_screen(RunPickerScreen(event.entries, peek=local), chosen)

    def on_source_reconnect_started(self, event: Source.ReconnectStarted) -> None:
        if self._stale(event):
            return
        self.state.mark("reconnecting")

    def on_source_warning_raised(self, event: Source.WarningRaised) -> None:
        if self._stale(event):
            return
        self.notify(event.text, severity="warning")

    def on_tdbg_app_source_failed(self, event: SourceFailed) -> None:
        if self._stale(event):
            return
        self.state.mark("ended", event.reason)
        self.notify(event.reason, severity="error", timeout=10)

    # --- view ------------------------------------------------------------------------------

    def _repaint(self) -> None:
        now = self._clock()
        unchanged = self.state.revision == self._painted
        if unchanged and now - self._painted_at < CLOCK_INTERVAL:
            return
        if not self.screen_stack:
            return  # the app is shutting down: its screens are gone before its timers
        if isinstance(self.screen, HelpScreen):
            # The opaque help covers every panel: they are painted at the first tick after it
            # closes, not under it (painted there, each came back changed and all were drawn
            # again at once as Escape closed it). A first alert still rings.
            self._ring()
            return
        with self.batch_update():
            # Nothing new arrived: only the header's clocks (elapsed, stalled for) move.
            if not self.monitor.repaint(clock_only=unchanged and self._painted >= 0):
                return  # panels not mounted yet: the next tick tries again
        self._painted = self.state.revision
        self._painted_at = now
        self._ring()

    def _ring(self) -> None:
        """The bell (and a desktop notification where the terminal shows one) for each alert
        kind's first alert this viewer sees arrive (nothing when it is off, or a replay)."""
        if not self.ringer.enabled:
            return
        for alert in self.ringer.new(self.state):
            self.rings.append(alert.kind)
            self.ring(self.ringer.sequence(alert, str(self.state.run.get("name") or "run")))

    @staticmethod
    def _clock() -> float:
        return time.monotonic()

    # --- comparing with a recording (b) ----------------------------------------------------

    def action_compare_recording(self) -> None:
        """``b``: pick a recording to draw under this run's loss, as ``--compare`` does; while
        one is drawn, the offer to stop comparing."""
        if isinstance(self.screen, ComparePickerScreen | ClearCompareScreen):
            return
        if self.baselines:
            names = [name for name, _ in self.baselines]
            self.push_screen(ClearCompareScreen(names), self._cleared)
            return
        mine = self.own_recording()
        searched = search_directories(self.state.run.get("cwd"), mine)
        files = nearby_recordings(searched, skip=mine)
        self.push_screen(ComparePickerScreen(files, searched), self._picked)

    def own_recording(self) -> Path | None:
        """The recording on screen (a replay's): not offered to compare with itself."""
        return None

    def _cleared(self, clear: bool | None) -> None:
        if clear:
            self.set_baselines([])
            self.notify("comparison cleared")

    def _picked(self, path: Path | None) -> None:
        if path is not None:
            self._load_baseline(path)

    @work(thread=True, group="baseline", exclusive=True, exit_on_error=False)
    def _load_baseline(self, path: Path) -> None:
        """Read the recording off the UI thread (a long run's file takes a while); a file that
        is none, or is damaged past reading, is one line, never a traceback."""
        from tdbg.model.recordings import load_run
        from tdbg.recording.reader import RecordingError

        try:
            state = load_run(path)
        except (RecordingError, OSError) as exc:
            self.call_from_thread(self.notify, _one_line(f"{path}: {exc}"), severity="error")
            return
        except Exception as exc:  # any reader bug on a strange file must not end the monitor
            why = f"{path}: cannot be read ({type(exc).__name__}: {exc})"
            self.call_from_thread(self.notify, _one_line(why), severity="error")
            return
        if not state.n_steps:
            self.call_from_thread(
                self.notify, f"{path.name}: no steps to compare with", severity="warning"
            )
            return
        self.call_from_thread(self._compared, path, state)

    def _compared(self, path: Path, state: RunState) -> None:
        self.set_baselines([(path.name, state)])
        self.notify(f"comparing with {path.name} (b again to clear)")

    def set_baselines(self, baselines: list[tuple[str, RunState]]) -> None:
        """Draw these runs under this one's loss from now on (none: stop comparing)."""
        self.baselines[:] = baselines
        self.monitor.baselines = self.baselines
        self.monitor.repaint(force=True)

    # --- the command palette (ctrl+p) and switching runs -----------------------------------

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """tdbg's own actions first (each runs what its key runs), then Textual's (its Quit is
        ours)."""
        yield from palette_commands(self, self.monitor)
        for command in super().get_system_commands(screen):
            if command.title != "Quit":
                yield command

    def runs_directory(self) -> Path | None:
        """Where the runs this app can switch to live: the local runtime directory (or the
        one the run was found in); None for a replay or a remote source."""
        remote = sys.modules.get("tdbg.tui.sources.remote")  # loaded only if a source is remote
        if remote is not None and isinstance(self.source, remote.RemoteSource):
            return None
        if not isinstance(self.source, SocketSource):
            return None
        return self.source.directory or runtime_dir()

    def action_switch_run(self) -> None:
        """``r``: the picker over this machine's runs; the one chosen replaces the one shown."""
        directory = self.runs_directory()
        if directory is None:
            self.notify("switching runs works on this machine's runs only", severity="warning")
            return
        if isinstance(self.screen, RunPickerScreen):
            return
        entries = discover(directory)
        if not entries:
            self.notify(f"no tdbg runs in {directory}", severity="warning")
            return
        current = Path(self.source.path) if isinstance(self.source, SocketSource) else None
        picker = RunPickerScreen(entries, attached=current or Path(), peek=True)
        self.push_screen(picker, lambda entry: self.switch_to(entry, directory))

    def switch_to(self, entry: RunEntry | None, directory: Path | None = None) -> None:
        """Show ``entry`` instead of the current run: its source, state and screen start
        afresh (the old run's data, deep dives and notices are dropped), and the old source
        is closed; whatever its worker still posts is dropped as stale."""
        if entry is None:
            return
        if isinstance(self.source, SocketSource) and Path(self.source.path) == entry.socket:
            return  # already on screen
        old = self.source
        self.source = SocketSource(path=entry.socket, directory=directory or entry.socket.parent)
        old.close()
        self.state = RunState(dict(entry.meta))
        self.ringer = AlertRinger()  # another run: its kinds ring anew
        self._painted = -1
        self._shown_data = False
        self.monitor.show(self.state)
        self.notify(f"switched to run {entry.name} (pid {entry.pid})")
        self._pump()  # exclusive in its group: the old worker is cancelled


def _one_line(text: str) -> str:
    """A message for a toast: its first line, cut to fit one."""
    first = (text.strip().splitlines() or [""])[0]
    return first if len(first) <= 160 else first[:159] + "…"


def make_app(source: Source) -> TdbgApp:
    """The app for a source: the CLI, the demos and the tests all build it this way."""
    return TdbgApp(source)


def save_screenshot(app: App[Any], path: str | Path) -> str:
    """Write an SVG screenshot of a running app (e.g. inside ``run_test``) to ``path``."""
    target = Path(path)
    return app.save_screenshot(filename=target.name, path=str(target.parent or "."))


def screen_text(app: App[Any]) -> str:
    """The current screen as plain text, as a user would read it (tests assert on this).

    Read back from Textual's public screenshot (an SVG from Rich's ``export_svg``, the same
    picture ``save_screenshot`` writes): each run of text is a ``<text>`` element whose
    ``clip-path`` names its line and whose ``x`` is its column times the cell width. Textual has
    no public call that returns the composited screen as text, only this picture.
    """
    width, height = app.size
    cells = [[" "] * width for _ in range(height)]
    cell_width = 0.0
    svg = ElementTree.fromstring(app.export_screenshot(simplify=True))
    for run in svg.iter("{http://www.w3.org/2000/svg}text"):
        line = re.fullmatch(r"url\(#.+-line-(\d+)\)", run.get("clip-path", ""))
        text = (run.text or "").rstrip("\n").replace("\xa0", " ")  # Rich writes spaces as nbsp
        if line is None or not text:
            continue  # the window title, or the end of a line
        if not cell_width:  # textLength is the cell width times len(text), wide or not
            cell_width = float(run.get("textLength", "0")) / len(text)
        y, x = int(line.group(1)), round(float(run.get("x", "0")) / cell_width)
        if y >= height:
            continue
        row = cells[y]
        for char in text:
            if x >= width:
                break
            size = cell_len(char)
            if size == 0 and x > 0:  # a combining mark joins the cell before it
                row[x - 1] += char
                continue
            row[x] = char
            for k in range(x + 1, min(x + size, width)):
                row[k] = ""  # the right half of a wide character
            x += max(size, 1)
    return "\n".join("".join(row) for row in cells)
