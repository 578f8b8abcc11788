"""MonitorScreen: the one-screen dashboard; lays out the panels and repaints them from RunState."""

from __future__ import annotations

import time
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Sparkline

from tdbg.tui.model import RunState, fmt, fmt_loss
from tdbg.tui.widgets.alert_list import AlertList
from tdbg.tui.widgets.anatomy_bar import AnatomyBar
from tdbg.tui.widgets.gradient_heatmap import GradientHeatmap
from tdbg.tui.widgets.gradient_table import GradientTable
from tdbg.tui.widgets.learning_rates import LearningRates
from tdbg.tui.widgets.loss_chart import LossChart
from tdbg.tui.widgets.memory_panel import MemoryPanel
from tdbg.tui.widgets.probe_status import ProbeStatus
from tdbg.tui.widgets.profiler_panel import ProfilerPanel
from tdbg.tui.widgets.run_header import RunHeader

RECENT_LOSS = 200  # steps shown in the loss sparkline
GRAD_INTERVAL = 0.5  # seconds between gradient panel updates: 1,000 rows at 8 Hz is wasted work
CHART_INTERVAL = 0.25


class Panel(Vertical, can_focus=True):
    """A bordered, focusable panel; tab cycles between them."""


class MonitorScreen(Screen[None]):
    BINDINGS = [
        Binding("l", "toggle_log", "Log scale"),
        Binding("h", "toggle_heatmap", "Heatmap"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("p", "profile", "Profile"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log_scale = False
        self.heatmap = False
        self._grads_at = 0.0
        self._chart_at = 0.0
        self._grad_revision = -1
        self._state: RunState | None = None

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield AnatomyBar(id="anatomy")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                with Panel(id="loss-panel", classes="panel"):
                    yield LossChart(id="loss-chart")
                    yield Sparkline([], id="loss-recent")
                with Horizontal(id="left-bottom"):
                    with Panel(id="lr-panel", classes="panel"):
                        yield LearningRates(id="lr")
                    with Panel(id="alerts-panel", classes="panel"):
                        yield AlertList(id="alerts")
            with Vertical(id="right"):
                with Vertical(id="grad-panel", classes="panel"):
                    with ContentSwitcher(initial="grad-table", id="grad-switcher"):
                        yield GradientTable(id="grad-table")
                        yield GradientHeatmap(id="grad-heatmap")
                with Panel(id="memory-panel", classes="panel"):
                    yield MemoryPanel(id="memory")
                with Panel(id="profiler-panel", classes="panel"):
                    yield ProfilerPanel(id="profiler")
        yield ProbeStatus(id="status")
        yield Footer()

    def on_mount(self) -> None:
        titles = {
            "loss-panel": "Loss",
            "lr-panel": "Learning rate",
            "alerts-panel": "Alerts",
            "grad-panel": "Gradient norms per layer",
            "memory-panel": "Memory",
            "profiler-panel": "Profiler top-ops",
        }
        for panel_id, title in titles.items():
            self.query_one(f"#{panel_id}").border_title = title

    # --- actions --------------------------------------------------------------------------

    def action_toggle_log(self) -> None:
        self.log_scale = not self.log_scale
        self._chart_at = 0.0
        self.repaint(force=True)

    def action_toggle_heatmap(self) -> None:
        self.heatmap = not self.heatmap
        switcher = self.query_one("#grad-switcher", ContentSwitcher)
        switcher.current = "grad-heatmap" if self.heatmap else "grad-table"
        self._grads_at = 0.0
        self.repaint(force=True)

    def action_cycle_sort(self) -> None:
        mode = self.query_one("#grad-table", GradientTable).cycle_sort()
        self._update_grad_title()
        self.notify(f"gradient table sorted by {mode}", timeout=2)

    def action_profile(self) -> None:
        self.notify("On-demand profiling comes with the deep-dive commands.", timeout=3)

    # --- painting -------------------------------------------------------------------------

    def show(self, state: RunState) -> None:
        self._state = state
        self.repaint(force=True)

    def repaint(self, force: bool = False) -> bool:
        """Refresh every panel from the state; heavy panels at their own, lower rate.

        False when there is nothing to paint yet: the repaint timer can fire between the
        screen's mount and its panels' (seen at start-up under load), and must not crash the app.
        """
        state = self._state
        if state is None or not self.is_mounted or not self.query(ProbeStatus):
            return False  # ProbeStatus is composed last: when it is there, every panel is
        now = time.monotonic()
        self.set_class(state.diverged, "-diverged")
        self.set_class(state.ended, "-ended")
        self.set_class(state.input_bound, "-input-bound")
        self.query_one(RunHeader).show(state)
        self.query_one(AnatomyBar).show(state)
        if force or now - self._chart_at >= CHART_INTERVAL:
            self._chart_at = now
            self._paint_loss(state)
        self.query_one(LearningRates).show(state)
        self.query_one(AlertList).show(state)
        self.query_one("#alerts-panel").border_subtitle = f"{state.alert_count} total"
        self.query_one(MemoryPanel).show(state)
        self.query_one(ProbeStatus).show(state)
        grads_changed = state.grads.total_rows != self._grad_revision
        if (force or grads_changed) and (force or now - self._grads_at >= GRAD_INTERVAL):
            self._grads_at = now
            self._grad_revision = state.grads.total_rows
            self._paint_grads(state)
        return True

    def _paint_loss(self, state: RunState) -> None:
        chart = self.query_one(LossChart)
        chart.replot(state.steps.values, state.loss.values, state.loss_ema.values, self.log_scale)
        recent = state.loss.values[-RECENT_LOSS:]
        self.query_one("#loss-recent", Sparkline).data = [
            float(v) for v in recent if v == v and abs(v) != float("inf")
        ]
        panel = self.query_one("#loss-panel")
        scale = "log" if self.log_scale else "linear"
        panel.border_subtitle = (
            f"last {fmt_loss(state.last_loss)} · smoothed {fmt(state.smoothed_loss, '.4g')}"
            f" · {scale} (l)"
        )

    def _paint_grads(self, state: RunState) -> None:
        names = state.layer_names
        if self.heatmap:
            steps, rows = state.grads.matrix()
            heatmap = self.query_one(GradientHeatmap)
            heatmap.show(names, steps, rows)
        else:
            table = self.query_one(GradientTable)
            table.show(names, state.grads.latest(), state.grads.recent(32), state.layer_trends())
        self._update_grad_title()

    def _update_grad_title(self) -> None:
        state = self._state
        panel = self.query_one("#grad-panel")
        sampled = "n/a" if state is None else fmt(state.grads.latest_step(), "d")
        if self.heatmap:
            caption = self.query_one(GradientHeatmap).caption
            panel.border_subtitle = f"heatmap 1e-8…1e4 · {caption} · h: table"
        else:
            mode = self.query_one(GradientTable).sort_mode
            panel.border_subtitle = f"step {sampled} · sort {mode} (s) · h: heatmap"
