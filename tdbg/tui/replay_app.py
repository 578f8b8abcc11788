"""``tdbg-tui replay FILE``: the monitor over a recording, with a cursor to move through time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer

from tdbg.model.timeline import Timeline
from tdbg.recording.reader import Recording
from tdbg.tui.app import TdbgApp
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.sources.base import Source
from tdbg.tui.widgets.replay_cursor import ReplayCursor

READ_ONLY = "a recording cannot run commands"
JUMP_SHARE = 0.05  # shift+arrow moves this share of the recording ...
MIN_JUMP = 10  # ... and at least this many recorded steps
PAINT_DELAY = 0.04  # seconds of quiet keys before the full repaint at the new cursor


class RecordingSource(Source):
    """A recording as a source: its run info, nothing to read live, no way back to a probe."""

    read_only_reason = READ_ONLY

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self.run = dict(recording.run)
        self.label = str(recording.path)
        self.end_reason = "replay"


class ReplayMonitorScreen(MonitorScreen):
    """The monitor with a cursor line; the cursor keys are priority bindings, so they move the
    cursor whichever panel has focus (the gradient table's own arrow keys included)."""

    BINDINGS = [
        Binding("left", "move(-1)", "Step ←", priority=True, show=False),
        Binding("right", "move(1)", "Step →", priority=True, show=False),
        Binding("shift+left", "jump(-1)", "Jump ←", priority=True, show=False),
        Binding("shift+right", "jump(1)", "Jump →", priority=True, show=False),
        Binding("home", "edge(0)", "First", priority=True, show=False),
        Binding("end", "edge(1)", "Last", priority=True, show=False),
    ]

    def compose(self) -> ComposeResult:
        yield ReplayCursor(id="replay-cursor")
        yield from super().compose()

    def on_mount(self) -> None:
        app = self.app
        if isinstance(app, ReplayApp):
            app.show_cursor()

    def unavailable(self, command: str) -> str | None:
        return READ_ONLY

    def action_cancel_job(self) -> None:
        self.notify(f"cancel unavailable: {READ_ONLY}", severity="warning", timeout=5)

    def action_move(self, delta: int) -> None:
        app = self.app
        if isinstance(app, ReplayApp):
            app.move_cursor(app.cursor + delta)

    def action_jump(self, direction: int) -> None:
        app = self.app
        if isinstance(app, ReplayApp):
            jump = max(MIN_JUMP, int(len(app.timeline) * JUMP_SHARE))
            app.move_cursor(app.cursor + direction * jump)

    def action_edge(self, end: int) -> None:
        app = self.app
        if isinstance(app, ReplayApp):
            app.move_cursor(len(app.timeline) - 1 if end else 0)


class ReplayApp(TdbgApp):
    """The monitor over a Timeline: the state shown is the timeline's at ``cursor``."""

    def __init__(self, timeline: Timeline, source: RecordingSource | None = None) -> None:
        super().__init__(source or RecordingSource(timeline.recording))
        self.timeline = timeline
        self.cursor = timeline.clamp(len(timeline) - 1)  # opens at the end, as a crash is read
        self.state = timeline.state_at(self.cursor)
        self._cursor_revision = 0
        self._paint_timer: Timer | None = None
        self.shown = self.cursor  # the cursor index every panel shows

    def get_default_screen(self) -> Screen[Any]:
        return ReplayMonitorScreen(id="monitor")

    def start_reading(self) -> None:
        """Nothing to read: the recording was loaded before the app started."""

    def own_recording(self) -> Path | None:
        return self.timeline.recording.path.resolve()

    def on_mount(self) -> None:
        self.ringer.enabled = False  # a recording is looked back at: nothing to ring for
        self.monitor.baselines = self.baselines
        self.show_cursor()
        if self.timeline.note:
            self.notify(self.timeline.note, severity="warning", timeout=10)

    def move_cursor(self, index: int) -> None:
        """Show the state at recorded step ``index``: the cursor line and the light panels at
        once, the full repaint (charts, gradient panel) once the keys pause for PAINT_DELAY, so
        a held arrow key glides instead of queueing repaints."""
        index = self.timeline.clamp(index)
        if index == self.cursor and self.state.n_steps:
            return
        self.cursor = index
        state = self.timeline.state_at(index)
        self._cursor_revision += 1
        state.revision = self._cursor_revision
        self.state = state
        self.show_cursor()
        if self._paint_timer is not None:
            self._paint_timer.stop()
        self._paint_timer = self.set_timer(PAINT_DELAY, self._paint_cursor)

    def _paint_cursor(self) -> None:
        self._paint_timer = None
        self.monitor.show(self.state)
        self.shown = self.cursor

    @property
    def settled(self) -> bool:
        """Every panel shows the cursor's state (tests poll this instead of sleeping)."""
        return self._paint_timer is None and self.shown == self.cursor

    @property
    def file_state(self) -> str | None:
        """How the file ends, when not cleanly: ``damaged`` (a checksum mismatch or garbage:
        see the notification) or ``killed`` (cut short: no end marker, or a last write cut off
        by the kill — the run was killed, or is still running)."""
        recording = self.timeline.recording
        if recording.damaged:
            return "damaged"
        if recording.stopped is not None or not self.timeline.ended:
            return "killed"
        return None

    def show_cursor(self) -> None:
        """Show the cursor line at ``cursor`` (the light part of a move: no panel repaint)."""
        timeline = self.timeline
        cursors = self.monitor.query(ReplayCursor)
        if not cursors:
            return
        cursors.first().show(
            timeline.step_at(self.cursor),
            timeline.step_at(len(timeline) - 1),
            self.cursor,
            len(timeline),
            timeline.time_at(self.cursor),
            timeline.created,
            self.file_state,
        )


def load(path: str) -> Timeline:
    """Read a recording into a Timeline; RecordingError when it is not one."""
    return Timeline(Recording(path))
