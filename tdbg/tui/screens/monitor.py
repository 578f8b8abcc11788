"""MonitorScreen: the one-screen dashboard; lays out the panels and repaints them from RunState."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import ContentSwitcher, DataTable, Input, Sparkline, Static

from tdbg.format import fmt, fmt_loss, fmt_percent
from tdbg.model.chart_axes import StepWindow
from tdbg.model.cursor import layer_norm_at, metric_at, moved, step_time_at, total_norm_at
from tdbg.model.deep import DIVES, label
from tdbg.model.model_summary import model_summary
from tdbg.model.run_state import RunState
from tdbg.protocol.messages.commands import COMMANDS
from tdbg.tui.screens.alert_detail import AlertDetailScreen
from tdbg.tui.screens.console import ConsoleScreen
from tdbg.tui.screens.distribution import DistributionScreen
from tdbg.tui.screens.model_info import ModelInfoScreen
from tdbg.tui.screens.profile_form import ProfileFormScreen
from tdbg.tui.widgets.activation_table import ActivationTable
from tdbg.tui.widgets.alert_list import AlertList
from tdbg.tui.widgets.anatomy_bar import AnatomyBar
from tdbg.tui.widgets.anomaly_banner import AnomalyBanner
from tdbg.tui.widgets.deep_panel import DeepPanel
from tdbg.tui.widgets.fit import Part, fit_parts
from tdbg.tui.widgets.gradient_heatmap import GradientHeatmap
from tdbg.tui.widgets.gradient_panel import GradientPanel
from tdbg.tui.widgets.gradient_table import GradientTable
from tdbg.tui.widgets.learning_rates import LearningRates
from tdbg.tui.widgets.loss_chart import PALETTE, LossChart
from tdbg.tui.widgets.memory_panel import MemoryPanel
from tdbg.tui.widgets.metric_table import MetricTable
from tdbg.tui.widgets.probe_status import ProbeStatus
from tdbg.tui.widgets.profiler_panel import HINT
from tdbg.tui.widgets.profiler_table import ProfilerTable
from tdbg.tui.widgets.run_header import RunHeader
from tdbg.tui.widgets.steady import SteadyStatic, set_border, set_classes
from tdbg.tui.widgets.steady_footer import SteadyFooter

RECENT_LOSS = 200  # steps shown in the loss sparkline
GRAD_INTERVAL = 0.5  # seconds between gradient panel updates: 1,000 rows at 8 Hz is wasted work
# Seconds between the charts' redraws while data arrives (keys redraw them at once). The loss
# chart costs ~1.5 ms to draw and paint at 120x40 since it is drawn in braille (plotext took
# ~22: benchmarks/chart_draw.py), but a chart repaint also redraws the metrics table; 4 Hz read
# a median 12.7 % of a core against 10.2 % at 2 Hz on the shared 2-core VM (benchmarks/README.md,
# tui.py), so 2 Hz stays while the TUI is over its 5 % budget.
CHART_INTERVAL = 0.5
WIDE = 170  # columns from which activations sit left-right of the gradient norms, not below
NARROW = 100  # columns below which the LR panel narrows so the alerts can be read
SHORT = 30  # rows below which the layout tightens (80x24): one-line header, no loss sparkline
TINY = 22  # rows below which only the verdict, the loss, the gradients and the alerts stay
CRAMPED = 40
TALL = 50  # rows from which the metrics table shows more names before it scrolls
MAX_OVERLAID = 6  # loss-like metrics drawn over the loss chart
# Other runs drawn under this one (``tdbg-tui RUN --compare OLD.tdbg``): their smoothed loss, each
# in its own colour kept for the session, apart from the metrics' palette.
BASELINE_COLOURS = ((150, 150, 150), (200, 120, 220), (90, 200, 200), (230, 200, 90))


def _rgb(colour: tuple[int, int, int]) -> str:
    return "rgb({},{},{})".format(*colour)


def _norm(value: float) -> str:
    """A max_norm as a script writes it: ``1.0``, ``0.5``, ``5.0``."""
    return f"{value:.1f}" if value == int(value) else f"{value:.3g}"


class Panel(Vertical, can_focus=True):
    """A bordered, focusable panel; tab cycles between them. ``z`` maximises it even where a
    widget inside took its tab stop."""

    ALLOW_MAXIMIZE = True


class Frame(Vertical):
    """A bordered panel whose content takes the focus (a table): ``z`` maximises the frame."""

    ALLOW_MAXIMIZE = True


def panel_of(widget: Widget | None) -> Widget | None:
    """The bordered panel (``.panel``) that holds ``widget``, or None."""
    node: Any = widget
    while isinstance(node, Widget):
        if node.has_class("panel"):
            return node
        node = node.parent
    return None


class MonitorScreen(Screen[None]):
    BINDINGS = [
        Binding("p", "profile", "Profile"),
        Binding("m", "snapshot", "Snapshot"),
        Binding("n", "nan_hunt", "NaN hunt"),
        Binding("a", "anomaly", "Anomaly"),
        Binding("s", "activations", "Act stats"),
        Binding("c", "cancel_job", "Cancel job", show=False),
        Binding("d", "cycle_view", "Dive view", show=False),
        Binding("left_square_bracket", "profile_sort(-1)", "Op sort ←", show=False),
        Binding("right_square_bracket", "profile_sort(1)", "Op sort →", show=False),
        Binding("z", "zoom", "Zoom", show=False),
        Binding("x", "close_deep", "Close dive", show=False),
        Binding("o", "cycle_sort", "Sort"),
        Binding("h", "toggle_heatmap", "Heatmap"),
        Binding("l", "toggle_log", "Log"),
        Binding("i", "model_info", "Model", show=False),
        Binding("u", "heatmap_updates", "Heatmap: norms / update ratios", show=False),
        Binding("g", "distributions", "Distributions", show=False),
        Binding("j", "console", "Console", show=False),
        # The gradient panel's own keys, from anywhere on the screen (it need not have focus).
        Binding("slash", "filter_layers", "Filter layers", show=False),
        Binding("t", "trend_scale", "Trend scale", show=False),
        # The inspect cursor: e turns it on; while on, the arrows move it (before any widget's
        # own arrow keys: see check_action) and escape leaves it.
        Binding("e", "inspect", "Inspect", show=False),
        Binding("left", "cursor_move(-1)", "Cursor ←", show=False, priority=True),
        Binding("right", "cursor_move(1)", "Cursor →", show=False, priority=True),
        Binding("shift+left", "cursor_move(-10)", "Cursor ← 10", show=False, priority=True),
        Binding("shift+right", "cursor_move(10)", "Cursor → 10", show=False, priority=True),
        Binding("escape", "leave_cursor", "Leave cursor", show=False, priority=True),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heatmap_updates = False  # the heatmap shows update ratios, not norms (u)
        self.heatmap = False
        # Other runs' states to overlay on the loss chart, with the names their legend shows.
        self.baselines: list[tuple[str, RunState]] = []
        self._forget_run()

    def _forget_run(self) -> None:
        """What the screen knows of the run it shows (not the user's choices of view): a
        screen re-pointed at another run (a job's ranks) starts from here again."""
        self.cursor_step: int | None = None  # the inspect cursor's step, while it is on
        self._loss_words: list[Part] = []  # the loss panel's bottom line, less its scale
        self._grads_at = 0.0
        self._chart_at = 0.0
        self._chart_revision = -1  # the state's revision the charts last showed
        self._grad_revision: tuple[int, int] = (-1, -1)
        self._state: RunState | None = None
        self._acts_shown: object = None
        self.chart_metric: str | None = None  # a metric charted in the loss panel (enter)
        # The newest dive when x closed the deep-dive panel: it stays closed until a newer one.
        self._deep_closed: object = None

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield AnomalyBanner(id="anomaly-banner")
        yield AnatomyBar(id="anatomy")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                with Panel(id="loss-panel", classes="panel"):
                    yield LossChart(id="loss-chart")
                    yield SteadyStatic(id="loss-legend")
                    yield Sparkline([], id="loss-recent")
                with Horizontal(id="left-bottom"):
                    with Panel(id="lr-panel", classes="panel"):
                        yield LearningRates(id="lr")
                    with Panel(id="alerts-panel", classes="panel"):
                        yield AlertList(id="alerts")
            with Vertical(id="right"):
                with Vertical(id="grad-area"):
                    with Frame(id="grad-panel", classes="panel"):
                        yield GradientPanel(id="grad-body")
                    with Frame(id="act-panel", classes="panel"):
                        yield ActivationTable(id="act-table")
                with Panel(id="memory-panel", classes="panel"):
                    yield MemoryPanel(id="memory")
        with Panel(id="metrics-panel", classes="panel"):
            yield SteadyStatic(id="metrics-line")  # the table in one line, on short terminals
            yield MetricTable(id="metrics")
        with Panel(id="profiler-panel", classes="panel"):
            yield SteadyStatic(id="deep-strip")  # one dim line while no dive is shown
            yield DeepPanel(id="deep")
        yield ProbeStatus(id="status")
        yield SteadyFooter()

    def on_mount(self) -> None:
        titles = {
            "loss-panel": "Loss",
            "lr-panel": "Learning rate",
            "alerts-panel": "Alerts",
            "grad-panel": "Gradient norms per layer",
            "memory-panel": "Memory",
            "profiler-panel": "Profiler top-ops",
            "act-panel": "Activations per module (s turns off)",
            "metrics-panel": "Metrics",
        }
        for panel_id, title in titles.items():
            self.query_one(f"#{panel_id}").border_title = title
        self._restore()

    # --- actions --------------------------------------------------------------------------

    def on_alert_list_alert_chosen(self, event: AlertList.AlertChosen) -> None:
        event.stop()
        self.app.push_screen(AlertDetailScreen(event.row))

    def action_heatmap_updates(self) -> None:
        """The heatmap's rows: gradient norms, or update ratios (each layer's ‖Δw‖/‖w‖)."""
        self.heatmap_updates = not self.heatmap_updates
        if not self.heatmap:
            self.action_toggle_heatmap()  # the ratios are a heatmap: show it
            return
        if self._state is not None:
            self._grad_revision = self._state.grads_revision
            self._paint_grads(self._state)

    def action_distributions(self) -> None:
        """The gradient table's layer (at its cursor): its weights' and gradients' histograms
        over the counted steps."""
        layer = None
        table = self.query_one(GradientTable)
        if table.row_count:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            layer = int(key) if key is not None else None
        self.app.push_screen(DistributionScreen(lambda: self._state, layer))

    def action_console(self) -> None:
        """The run's stdout and stderr: scrolled, searched (ConsoleScreen)."""
        self.app.push_screen(ConsoleScreen(lambda: self._state))

    def action_model_info(self) -> None:
        """What the run trains: its layers, parameters, frozen ones, dtypes and devices."""
        if self._state is not None:
            self.app.push_screen(ModelInfoScreen(model_summary(self._state)))

    @property
    def log_scale(self) -> bool:
        """The chart on show in the loss panel is on a log y-axis."""
        return self.query_one(LossChart).log_y

    def action_toggle_log(self) -> None:
        """Linear / log y for the chart on show (the loss, the step time, a metric): each
        keeps its own."""
        self.query_one(LossChart).toggle_log()  # its Changed message keeps the choice
        self._chart_at = time.monotonic()
        if self._state is not None:
            self._paint_loss(self._state)  # only the chart changes: not a whole-screen repaint

    # --- the inspect cursor -----------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("cursor_move", "leave_cursor"):
            # Only while the cursor is on (the arrows pan the chart and move table rows
            # otherwise), and never over the layer filter's typing.
            return self.cursor_step is not None and not isinstance(self.focused, Input)
        return True

    def action_inspect(self) -> None:
        """e: the cursor on the newest step the loss chart shows; e again leaves it."""
        state = self._state
        if self.cursor_step is not None:
            self.action_leave_cursor()
            return
        if state is None or not state.steps.n:
            self.notify("no steps yet to inspect", timeout=2)
            return
        chart = self.query_one(LossChart)
        span = (int(state.steps.values[0]), int(state.steps.values[-1]))
        self.cursor_step = chart.window.bounds(*span)[1]
        self._paint_cursor(state)

    def action_cursor_move(self, dots: int) -> None:
        state = self._state
        if state is None or self.cursor_step is None:
            return
        stride = self.query_one(LossChart).cursor_stride()
        self.cursor_step = moved(state, self.cursor_step, dots * stride)
        self._paint_cursor(state)

    def action_leave_cursor(self) -> None:
        self.cursor_step = None
        if self._state is not None:
            self._paint_cursor(self._state)

    def _paint_cursor(self, state: RunState) -> None:
        """What reads the cursor's step, and only that: the charts, learning rates, metrics."""
        self.set_class(self.cursor_step is not None, "-cursor")
        self._paint_loss(state)
        self.query_one(LearningRates).show(state, self.cursor_step)
        self._paint_metrics(state)
        self._paint_grad_summary(state)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """With the cursor on, the layer under the gradient table's row cursor is the one
        whose norm the summary line reads."""
        if self.cursor_step is not None and isinstance(event.data_table, GradientTable):
            if self._state is not None:
                self._paint_grad_summary(self._state)

    def action_filter_layers(self) -> None:
        self.query_one(GradientPanel).action_filter()

    def action_trend_scale(self) -> None:
        self.query_one(GradientPanel).action_trend_scale()

    def action_toggle_heatmap(self) -> None:
        self.heatmap = not self.heatmap
        switcher = self.query_one("#grad-switcher", ContentSwitcher)
        switcher.current = "grad-heatmap" if self.heatmap else "grad-table"
        self._remember(heatmap=self.heatmap)
        self._grads_at = time.monotonic()
        if self._state is not None:
            self._grad_revision = self._state.grads_revision
            self._paint_grads(self._state)  # only the gradient panel changes

    def action_cycle_sort(self) -> None:
        mode = self.query_one("#grad-table", GradientTable).cycle_sort()
        self._remember(grad_sort=mode)
        self._update_grad_title()
        self.notify(f"gradient table sorted by {mode}", timeout=2)

    # --- deep dives: every command goes through the app, which owns the source --------------

    def unavailable(self, command: str) -> str | None:
        """Why ``command`` cannot run on this run (from the welcome's ``commands``), or None; a
        screen over a source that runs nothing (a replay) overrides it."""
        state = self._state
        run = state.run if state is not None else {}
        reasons = run.get("commands")
        if isinstance(reasons, dict) and reasons.get(command):
            return str(reasons[command])
        device = run.get("device")
        if command == "snapshot" and isinstance(device, str) and device.startswith("cpu"):
            return f"needs CUDA: this run is on {device}"
        return None

    def _send(self, command: str, **args: Any) -> int | None:
        why = self.unavailable(command)
        if why is not None:
            self.notify(f"{label(command)} unavailable: {why}", severity="warning", timeout=5)
            return None
        send = getattr(self.app, "send_command", None)
        if send is None:  # a bare App (tests of the screen alone)
            self.notify("this app cannot send commands", severity="warning")
            return None
        mid: int | None = send(command, **args)
        if mid is not None:
            self.repaint(force=True)
        return mid

    def action_profile(self) -> None:
        why = self.unavailable("profile")
        if why is not None:
            self.notify(f"profile unavailable: {why}", severity="warning", timeout=5)
            return

        def submitted(args: dict[str, Any] | None) -> None:
            if args is not None:
                self._send("profile", **args)

        self.app.push_screen(ProfileFormScreen(), submitted)

    def action_snapshot(self) -> None:
        self._send("snapshot")

    def action_nan_hunt(self) -> None:
        # A key sends the command schema's defaults (its one owner): steps of the hunt, of
        # anomaly mode per press of a, the activation-statistics interval when s turns them on.
        self._send("nan_hunt", steps=COMMANDS["nan_hunt"]["steps"].default)

    def action_anomaly(self) -> None:
        self._send("anomaly", steps=COMMANDS["anomaly"]["steps"].default)

    def action_activations(self) -> None:
        state = self._state
        if state is not None and state.deep.activations_on:
            self._send("activations", enabled=False)
        else:
            self._send("activations", every=COMMANDS["activations"]["every"].default, enabled=True)

    def action_cancel_job(self) -> None:
        """Cancel the active dive shown in the deep-dive panel, else the newest active dive."""
        state = self._state
        if state is None:
            return
        deep = state.deep
        shown = self.query_one(DeepPanel).command()
        job = deep.active_job(shown)
        if job is None and shown == "nan_hunt":
            job = deep.active_job("anomaly")
        if job is None:
            active = [j for j in deep.jobs.values() if j.active and j.command in DIVES]
            job = max(active, key=lambda j: j.job, default=None)
        if job is None:
            self.notify("no deep dive is running", timeout=3)
            return
        if self._send("cancel", job=job.job) is not None:
            self.notify(f"cancelling {label(job.command)} #{job.job}", timeout=3)

    def action_cycle_view(self) -> None:
        self._deep_closed = None  # d on a closed panel opens it again
        self.query_one(DeepPanel).cycle_view()
        self.repaint(force=True)
        self.notify(f"deep-dive panel: {self.query_one(DeepPanel).title}", timeout=2)

    def action_profile_sort(self, step: int) -> None:
        table = self.query_one(ProfilerTable)
        if table.profile is None:
            self.notify("no profile yet: press p", timeout=3)
            return
        self.query_one(DeepPanel).switch("deep-profile")
        table.cycle_sort(step)

    def on_profiler_table_sorted(self, event: ProfilerTable.Sorted) -> None:
        self.repaint(force=True)

    def action_zoom(self) -> None:
        """Maximise the focused panel to the full screen (the deep-dive panel while it shows a
        dive and nothing has focus; else the loss); z or escape give the layout back."""
        if self.maximized is not None:
            self.minimize()
        else:
            panel = panel_of(self.focused)
            if panel is None or not panel.display:
                shown = self.has_class("-deep")
                panel = self.query_one("#profiler-panel" if shown else "#loss-panel")
            self.maximize(panel, container=False)

    def _watch_maximized(self, previously: Widget | None, maximized: Widget | None) -> None:
        """Textual's own watcher sets the screen's ``-maximized-view`` class with a restyle of
        the screen and every widget in it (~0.2 s of each z and escape here, loaded). Only the
        screen's own rules (Textual's ``Screen.-maximized-view``) and the panel's use these
        classes (nothing in tdbg.tcss reads ``-maximized-view``): restyle the screen alone, and
        the panel with its class."""
        self.set_class(maximized is not None, "-maximized-view", update=False)
        self.app.stylesheet.update_nodes([self], animate=False)
        if previously is not None:
            previously.remove_class("-maximized")
        if maximized is not None:
            maximized.add_class("-maximized")
        # Zoomed: the panel alone, in its full form (memory, metrics are compact beside the
        # others). Back: every panel, none of which was painted while hidden.
        self.repaint(force=True)

    def action_close_deep(self) -> None:
        """Close the deep-dive panel, giving its rows back, until the next dive (d reopens)."""
        state = self._state
        if state is None or not state.deep.has_any:
            self.notify("no deep dive to close", timeout=2)
            return
        self._deep_closed = self.query_one(DeepPanel).latest
        if self.maximized is not None and self.maximized.id == "profiler-panel":
            self.minimize()
        self.repaint(force=True)

    def on_resize(self) -> None:
        width, height = self.size
        set_classes(
            self,
            {
                "-wide": width >= WIDE,
                "-narrow": width < NARROW,
                "-short": height < SHORT,
                "-tiny": height < TINY,
                "-tall": height >= TALL,
                # With a deep dive open, fewer rows leave no room for the metrics table.
                "-cramped": height < CRAMPED,
                # Between the short layout and 40 rows: the loss chart takes the tables' rows.
                "-medium": SHORT <= height < CRAMPED,
            },
        )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a metric charts it in the loss panel; enter on it again goes back."""
        if not isinstance(event.data_table, MetricTable):
            return
        name = str(event.row_key.value)
        self.chart_metric = None if name == self.chart_metric else name
        self._chart_at = 0.0
        self.repaint(force=True)

    # --- painting -------------------------------------------------------------------------

    def show(self, state: RunState) -> None:
        self._state = state
        self.repaint(force=True)

    def repaint(self, force: bool = False, clock_only: bool = False) -> bool:
        """Refresh every panel from the state; heavy panels at their own, lower rate;
        ``clock_only``: nothing new arrived, only the header's clocks and verdict move.

        False when there is nothing to paint yet: the repaint timer can fire between the
        screen's mount and its panels' (seen at start-up under load), and must not crash the app.
        """
        state = self._state
        if state is None or not self.is_mounted or not self.query(ProbeStatus):
            return False  # ProbeStatus is composed last: when it is there, every panel is
        now = time.monotonic()
        wanted = {"-diverged": state.diverged, "-ended": state.ended}
        set_classes(self, {**wanted, "-input-bound": state.input_bound})
        shows = self._shows
        short = self.size.height < SHORT
        if shows("header"):
            self.query_one(RunHeader).show(state, two_lines=not short)
        charts_due = now - self._chart_at >= CHART_INTERVAL
        if clock_only and not force:
            # Data that came within CHART_INTERVAL of the last chart paint (a run's last batch)
            # is drawn at the next tick, not left off the charts until more data comes.
            if charts_due and self._chart_revision != state.revision:
                self._paint_charts(state, now)
            self._paint_grads_due(state, now, force)  # the same for the gradient panel
            return True
        if shows("anatomy"):
            self.query_one(AnatomyBar).show(state, compact=short)
        if force or charts_due:
            self._paint_charts(state, now)
        if shows("lr-panel"):
            self.query_one(LearningRates).show(state, self.cursor_step)
            lr_panel = self.query_one("#lr-panel")
            groups = state.param_groups
            capped = f"showing {state.lr_groups} of {groups}" if state.lr_columns_capped else ""
            set_border(lr_panel, subtitle=capped)
        self.set_class(bool(len(state.metrics)), "-metrics")
        if shows("alerts-panel"):
            self.query_one(AlertList).show(state)
            set_border(self.query_one("#alerts-panel"), subtitle=f"{state.alert_count} total")
        if shows("memory-panel"):
            zoomed = self.query_one("#memory-panel").has_class("-maximized")
            self.query_one(MemoryPanel).show(state, compact=short and not zoomed)
        if shows("status"):
            self.query_one(ProbeStatus).show(state)
        self._paint_deep(state)
        self._paint_grads_due(state, now, force)
        return True

    def _paint_grads_due(self, state: RunState, now: float, force: bool) -> None:
        """The gradient panel, when its norms changed and GRAD_INTERVAL has passed since it
        was last painted (or ``force``), and it is on screen."""
        grads_changed = state.grads_revision != self._grad_revision
        if not (force or grads_changed) or not (force or now - self._grads_at >= GRAD_INTERVAL):
            return
        if self._shows("grad-panel"):
            self._grads_at = now
            self._grad_revision = state.grads_revision
            self._paint_grads(state)

    def _shows(self, widget_id: str) -> bool:
        """Whether the screen shows the widget (a panel, the header) with this id: all of them
        unless one is zoomed (z), and then that one alone. Those hidden by a zoom are not
        painted at all (each was drawn at every tick under the zoomed panel); the zoom's end
        repaints them all (``_watch_maximized``)."""
        zoomed = self.maximized
        if zoomed is None:
            return True
        # Textual's own maximize (the palette's) can zoom a widget inside a panel.
        return zoomed.id == widget_id or any(node.id == widget_id for node in zoomed.ancestors)

    def _paint_charts(self, state: RunState, now: float) -> None:
        self._chart_at = now
        self._chart_revision = state.revision
        if self._shows("loss-panel"):
            self._paint_loss(state)
        if self._shows("metrics-panel"):
            self._paint_metrics(state)
        # Every step's clip figures, not only the sampled steps' norms: at the chart rate.
        if self._shows("grad-panel"):
            self._paint_grad_summary(state)

    def _paint_deep(self, state: RunState) -> None:
        deep = state.deep
        self.query_one(AnomalyBanner).show(deep)
        panel = self.query_one(DeepPanel)
        panel.show(deep, self.unavailable("snapshot"))  # may switch to the newest dive's view
        closed = self._deep_closed is not None and self._deep_closed == panel.latest
        set_classes(
            self,
            {
                "-anomaly": deep.anomaly_on,
                "-activations": deep.activations_on,
                # The panel takes rows only while it shows a dive; closed (x), one dim line.
                "-deep": deep.has_any and not closed,
                # Only the profile table needs the deep-dive panel's full height.
                "-deep-text": panel.view != "deep-profile",
            },
        )
        strip = HINT if not deep.has_any else f"{panel.title}: closed (x) · d: show it again"
        self.query_one("#deep-strip", Static).update(Text(strip, no_wrap=True, overflow="ellipsis"))
        border = self.query_one("#profiler-panel")
        set_border(border, title=panel.title)
        caption = "d: next view · c: cancel · z: zoom · x: close"
        if panel.view == "deep-profile" and deep.profile is not None:
            caption = f"{self.query_one(ProfilerTable).sort_caption()} ([ ]) · {caption}"
        set_border(border, subtitle=caption)
        if deep.activations_on:
            acts = deep.activations
            if acts is not self._acts_shown:  # a new sample every K steps, not every repaint
                self._acts_shown = acts
                self.query_one(ActivationTable).show(acts)
            every = fmt(deep.activations_every, "d")
            step = "n/a" if acts is None else fmt(acts.step, "d")
            words = f"step {step} · every {every} steps"
            set_border(self.query_one("#act-panel"), subtitle=words)

    def _paint_metrics(self, state: RunState) -> None:
        store = state.metrics
        if not len(store):
            return
        overlaid = store.loss_like()[:MAX_OVERLAID]
        colours = {s.name: _rgb(PALETTE[k % len(PALETTE)]) for k, s in enumerate(overlaid)}
        cursor = self.cursor_step
        self.query_one(MetricTable).show(store, colours, cursor)
        # Short terminals: the table as one line of latest values (z on it shows the table).
        dim = "dim"
        line = Text(f"Metrics ({len(store)}):", dim, no_wrap=True, overflow="ellipsis")
        for name in store.names:
            line.append(f"  {name} ", dim)
            point = metric_at(store[name], cursor) if cursor is not None else None
            line.append(fmt(store[name].last if cursor is None else point and point[1], ".4g"))
        self.query_one("#metrics-line", Static).update(line)
        panel = self.query_one("#metrics-panel")
        bad = sum(1 for name in store.names if store[name].nonfinite)
        subtitle = f"{len(store)} names"
        if bad:
            subtitle += f" · {bad} non-finite"
        if store.dropped_names:
            subtitle += f" · {store.dropped_names} points of further names dropped"
        set_border(panel, subtitle=subtitle + " · enter: chart")

    def _paint_loss(self, state: RunState) -> None:
        chart = self.query_one(LossChart)
        panel = self.query_one("#loss-panel")
        legend = self.query_one("#loss-legend", Static)
        cursor = self.cursor_step
        name = self.chart_metric
        if name is not None and name in state.metrics:
            series = state.metrics[name]
            x, y = series.step_values
            chart.set_cursor(cursor, draw=False)
            chart.replot(x, y, y[:0], name=name)
            set_border(panel, title=f"Metric {name}")
            self._loss_subtitle(
                state,
                [
                    (f"last {fmt(series.last, '.4g')} at step {fmt(series.last_step, 'd')}", 0),
                    (" · enter: back to loss", 3),
                ],
            )
            legend.update(Text(f"━ {name}", style=chart.color_style("loss-chart--raw")))
            return
        overlaid = [s for s in state.metrics.loss_like()][:MAX_OVERLAID]
        extra = [(*s.step_values, PALETTE[k % len(PALETTE)]) for k, s in enumerate(overlaid)]
        # Other runs up to this run's step: the case is a live run against yesterday's
        # recording at the same step (what lies ahead of it would stretch this run's axis).
        last = state.last_step
        fitted = []
        for k, (_, other) in enumerate(self.baselines):
            steps, ema = other.steps.values, other.loss_ema.values
            upto = int(np.searchsorted(steps, last, side="right")) if last is not None else 0
            colour = BASELINE_COLOURS[k % len(BASELINE_COLOURS)]
            fitted.append((steps[:upto], ema[:upto], colour))
        chart.set_cursor(cursor, draw=False)
        chart.replot(
            state.steps.values,
            state.loss.values,
            state.loss_ema.values,
            extra,
            present=state.has_loss.values,
            step_time=state.cols["step_time"].values,
            fitted=fitted,
        )
        parts = [("━ loss ", chart.color_style("loss-chart--raw"))]
        parts.append(("━ smoothed ", chart.color_style("loss-chart--smoothed")))
        for k, s in enumerate(overlaid):
            value = ""
            if cursor is not None:
                point = metric_at(s, cursor)
                value = f"{fmt(point and point[1], '.4g')} "
            parts.append((f"━ {s.name} {value}", _rgb(PALETTE[k % len(PALETTE)])))
        for k, (name, _) in enumerate(self.baselines):
            parts.append((f"━ {name} ", _rgb(BASELINE_COLOURS[k % len(BASELINE_COLOURS)])))
        legend.update(Text.assemble(*parts, no_wrap=True, overflow="ellipsis"))
        set_border(panel, title="Loss")
        recent = state.loss.values[-RECENT_LOSS:]
        self.query_one("#loss-recent", Sparkline).data = [
            float(v) for v in recent if v == v and abs(v) != float("inf")
        ]
        micro = state.micro_batches
        words: list[Part] = [("last ", 5), (fmt_loss(state.last_loss), 0)]
        if micro is not None and micro > 1:
            words.append((f" · {micro:g} micro-batches", 2))
        words.append((f" · smoothed {fmt(state.smoothed_loss, '.4g')}", 4))
        self._loss_subtitle(state, words)

    def on_loss_chart_changed(self, event: LossChart.Changed) -> None:
        if self._state is not None:
            self._loss_subtitle(self._state, self._loss_words)
        chart = self.query_one(LossChart)
        self._remember(
            chart_window=chart.window.size, full_range=chart.full_range, log_y=sorted(chart.logs)
        )

    def _remember(self, **changes: Any) -> None:
        remember = getattr(self.app, "remember", None)  # a bare App (tests of the screen)
        if remember is not None:
            remember(**changes)

    def _restore(self) -> None:
        """The choices the user made last time (the app read them): the gradients' view and
        sort, the loss chart's window, y-range and log scales."""
        settings = getattr(self.app, "settings", None)
        if settings is None:
            return
        chart = self.query_one(LossChart)
        chart.window = StepWindow(settings.chart_window)
        chart.full_range = settings.full_range
        chart.logs = set(settings.log_y)
        self.query_one(GradientTable).sort_mode = settings.grad_sort
        if settings.heatmap != self.heatmap:
            self.action_toggle_heatmap()

    def _loss_subtitle(self, state: RunState, words: list[Part]) -> None:
        """The loss panel's bottom line, fitted to its width: the scale and its key first;
        with the cursor on, its keys and the step time at its step instead of the latest."""
        self._loss_words = words
        chart = self.query_one(LossChart)
        panel = self.query_one("#loss-panel")
        # A narrow panel (80 columns) says "lin": the scale's key and the loss both fit.
        linear = "linear" if panel.size.width >= 50 else "lin"
        scale: list[Part] = [(" · log (l)" if chart.log_y else f" · {linear} (l)", 1)]
        if self.cursor_step is not None:
            ms = step_time_at(state, self.cursor_step)
            words = [("cursor ← → · esc", 0)]
            if ms is not None:
                words.append((f" · step time {fmt(ms * 1000, '.3g')} ms", 1))
            scale = [(scale[0][0], 2)]
        # The border line's room: the frame less its corners and a dash and space each side.
        line = fit_parts([*words, *scale], max(1, panel.outer_size.width - 6))
        set_border(panel, subtitle=line.plain.removeprefix(" · "))

    def _paint_grads(self, state: RunState) -> None:
        names = state.layer_names
        if self.heatmap:
            heatmap = self.query_one(GradientHeatmap)
            if self.heatmap_updates:
                # A layer not measured at a step (the layers take turns on a large model) is
                # no value there, not a non-finite one.
                steps, rows = state.update_matrix()
                heatmap.show(names, steps, rows, np.isnan(rows))
            else:
                steps, rows = state.grads.matrix()
                heatmap.show(names, steps, rows, state.absent(steps, rows))
        else:
            table = self.query_one(GradientTable)
            owners = [state.layer_owner(i) for i in range(len(names))]
            recent = state.grads.recent(32)
            recent_absent = state.absent(state.grads.recent_steps(32), recent)
            table.show(
                names,
                state.grads.latest(),
                recent,
                state.layer_trends(),
                owners,
                absent=recent_absent[-1] if len(recent_absent) else None,  # the latest row's
                recent_absent=recent_absent,
                gone=frozenset(state.presence.gone_at),
                updates=state.update_ratios(),
            )
        self._update_grad_title()

    def _paint_grad_summary(self, state: RunState) -> None:
        """The total norm (per model when several), and what clip_grad_norm_ did: the norms
        shown are the ones measured before clipping."""
        parts = []
        if self.cursor_step is not None:
            parts.append(self._grad_at_cursor(state, self.cursor_step))
        clip = state.clipping()
        totals = state.grad_total.values
        if clip is not None:
            parts.append(
                f"clip {_norm(clip.max_norm)} · active {fmt_percent(clip.active_share, '.0f')}% "
                f"of steps · pre-clip total {fmt(clip.last_norm, '.3g')}"
            )
        elif len(totals):
            parts.append(f"total {fmt(float(totals[-1]), '.3g')}")
        latest = state.grads.latest()
        models = state.models
        if latest is not None and len(models) > 1 and len(state.layer_model) == len(latest):
            owner = np.asarray(state.layer_model)
            for m, name in enumerate(models):
                mine = latest[owner == m].astype(np.float64)
                if mine.size:
                    parts.append(f"{name} {fmt(float(np.sqrt(np.nansum(mine * mine))), '.3g')}")
        self.query_one("#grad-summary", Static).update(
            Text(" · ".join(parts), no_wrap=True, overflow="ellipsis")
        )
        title = "Gradient norms per layer" if self.size.width >= 100 else "Grad norms"
        if clip is not None:
            title += " (pre-clip)"
        self.query_one(GradientPanel).set_title(title)

    def _grad_at_cursor(self, state: RunState, step: int) -> str:
        """``▏step N total X · LAYER Y``: the sampled step at or before the cursor's, and the
        norm of the layer under the table's row cursor."""
        total = total_norm_at(state, step)
        if total is None:
            return f"▏step {step}: no norms yet"
        text = f"▏step {total[0]} total {fmt(total[1], '.3g')}"
        layer = self.query_one(GradientTable).selected_layer()
        norm = None if layer is None else layer_norm_at(state, layer, step)
        if layer is not None and norm is not None and layer < len(state.layer_names):
            text += f" · {state.layer_names[layer]} {fmt(norm[1], '.3g')}"
        return text

    def _update_grad_title(self) -> None:
        state = self._state
        panel = self.query_one(GradientPanel)  # it adds the filter and the trend scale
        sampled = "n/a" if state is None else fmt(state.grads.latest_step(), "d")
        if self.heatmap:
            if self.heatmap_updates:
                panel.set_subtitle(
                    [
                        ("heatmap", 0),
                        (" · update ratios ‖Δw‖/‖w‖", 0),
                        (" · u: norms", 1),
                        (" · h: table", 2),
                    ]
                )
            elif state is not None and state.update_ratio:  # the run sends ratios: say the key
                panel.set_subtitle([("heatmap", 0), (" · u: ratios", 1), (" · h: table", 2)])
            else:
                panel.set_subtitle([("heatmap", 0), (" · h: table", 1)])
        else:
            mode = self.query_one(GradientTable).sort_mode
            panel.set_subtitle(
                [(f"step {sampled}", 2), (f" · sort {mode} (o)", 0), (" · h: heatmap", 2)]
            )
