"""JobScreen: a distributed job whole — its line, the rank table worst first, which rank was the
slowest over time, its live alerts; Enter opens one rank's full single-run screen (RankScreen),
Esc comes back; p profiles every rank (JobProfileScreen)."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Static

from tdbg.format import fmt, fmt_loss
from tdbg.model.job import Job
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_table import JobSummary, rank_rows, summarize
from tdbg.model.straggler_history import WINDOW, StragglerHistory
from tdbg.tui.colours import meaning
from tdbg.tui.screens.monitor import MonitorScreen
from tdbg.tui.widgets.activation_table import ActivationTable
from tdbg.tui.widgets.deep_panel import DeepPanel
from tdbg.tui.widgets.rank_table import RankTable
from tdbg.tui.widgets.steady_footer import SteadyFooter

MAX_ALERTS_SHOWN = 50
MAX_SLOWEST_SHOWN = 3  # ranks in the slowest-over-time panel: the record's leaders
# A severity's colour in the palette chosen (colour-blind safe or the theme's): its meaning.
SEVERITY_MEANING = {"error": ("bad", True), "warning": ("warn", False)}


class JobScreen(Screen[None]):
    """Dumb view: ``show(job, alerts)`` repaints; Enter on a rank asks the app to open it."""

    BINDINGS = [
        Binding("enter", "open_rank", "Open rank", show=True),
        Binding("p", "profile_job", "Profile ranks"),
    ]
    # The rank table takes what its rows need (up to most of the screen); alerts the rest.
    DEFAULT_CSS = """
    JobScreen #job-ranks { height: auto; max-height: 70%; border: round $primary; }
    JobScreen #rank-table { height: auto; max-height: 100%; }
    JobScreen #job-slowest { height: auto; max-height: 8; border: round $primary; }
    JobScreen #job-alerts { height: 1fr; min-height: 5; border: round $primary; }
    JobScreen #job-line { text-style: bold; }
    JobScreen #job-nodes { color: $warning; display: none; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="job-line")
        yield Static(id="job-nodes")
        yield Static(id="job-rule")
        with Vertical(id="job-ranks", classes="panel"):
            yield RankTable(id="rank-table")
        with Vertical(id="job-slowest", classes="panel"):
            yield Static(id="job-slowest-list")
        with Vertical(id="job-alerts", classes="panel"):
            yield Static("no job alerts", id="job-alert-list")
        yield SteadyFooter()

    def on_mount(self) -> None:
        self.query_one("#job-ranks").border_title = "Ranks (worst first; Enter opens one)"
        self.query_one("#job-slowest").border_title = "Slowest rank over time"
        self.query_one("#job-alerts").border_title = "Job alerts"
        self.show_nodes(getattr(self.app, "node_lines", []))

    def show_nodes(self, lines: list[str]) -> None:
        """The nodes that are not read (unreachable, reconnecting) and a tdbg version mismatch,
        one line each; hidden when there is nothing to say."""
        line = self.query_one("#job-nodes", Static)
        line.update(Text("\n".join(f"! {text}" for text in lines)))
        line.display = bool(lines)

    def show(self, job: Job, alerts: JobAlerts) -> bool:
        """Paint the job; False when the panels are not all there: before they are mounted, or
        while the app shuts down and removes them (a repaint tick can fire in between)."""
        if not self.is_mounted or not self.query(SteadyFooter):
            return False
        try:
            self.query_one("#job-line", Static).update(_job_line(job, summarize(job)))
            self.query_one("#job-rule", Static).update(Text(f"divergence check {alerts.rule}"))
            self.query_one(RankTable).show(rank_rows(job, alerts))
            self.query_one("#job-slowest-list", Static).update(slowest_text(alerts.history))
            self.query_one("#job-slowest").border_subtitle = judged_words(alerts.history)
            self.query_one("#job-alert-list", Static).update(alert_text(alerts, self.app))
        except NoMatches:
            return False
        return True

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The cursor's rank and row in the panel's bottom edge (which rank Enter opens)."""
        table = self.query_one(RankTable)
        rank = table.selected_rank
        where = f"rank {rank} · row {event.cursor_row + 1} of {table.row_count}"
        self.query_one("#job-ranks").border_subtitle = "" if rank is None else where

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self._open(int(event.row_key.value))

    def action_open_rank(self) -> None:
        rank = self.query_one(RankTable).selected_rank
        if rank is not None:
            self._open(rank)

    def action_profile_job(self) -> None:
        """Profile the same steps on every live rank; the comparison opens over this screen."""
        profiler = getattr(self.app, "profile_job", None)
        if profiler is not None:
            profiler()

    def _open(self, rank: int) -> None:
        opener = getattr(self.app, "open_rank", None)
        if opener is not None:
            opener(rank)


def _job_line(job: Job, summary: JobSummary) -> Text:
    text = Text()
    text.append(f"job {job.job}", style="bold")
    text.append(f"  {summary.ranks_seen} of {summary.world_size} ranks")
    missing = job.missing_ranks()
    unwatched = job.unwatched_line(time.time())
    if unwatched is not None:  # under `tdbg run`: as it says it on stderr
        text.append(f" ({unwatched})", style="yellow")
    elif missing:  # not yet started, or on a node not read
        text.append(f" (missing {', '.join(map(str, missing[:8]))})", style="yellow")
    text.append(f"  step {summary.step if summary.step is not None else '-'}")
    text.append(f"  loss {fmt_loss(summary.loss)} (mean of ranks)")
    rate = summary.steps_per_sec
    text.append(f"  {fmt(rate, '.3g') if rate is not None else '-'} steps/s")
    if summary.samples_per_sec is not None:
        text.append(f"  {fmt(summary.samples_per_sec, '.4g')} samples/s")
    return text


def slowest_text(history: StragglerHistory) -> Text:
    """The ranks most often the slowest over the recent span, one line each (the named ones
    in the warning colour, the rest dim), or why none is named."""
    records = history.records()[:MAX_SLOWEST_SHOWN]
    if not records or not any(r.kind for r in records):
        text = Text(history.line(), style="dim")
        if records:  # slowest now and then, too little to name: shown, not named
            text.append("\n" + "\n".join(r.words() for r in records), style="dim")
        return text
    text = Text()
    for i, record in enumerate(records):
        if i:
            text.append("\n")
        text.append(record.words(), style="yellow" if record.kind else "dim")
    return text


def judged_words(history: StragglerHistory) -> str:
    """The panel's bottom edge: how much is judged, and how often."""
    if history.since is None:
        return ""
    return (
        f"judged every {WINDOW} steps since step {history.since} ({history.judged * WINDOW} steps)"
    )


def alert_text(alerts: JobAlerts, app: Any) -> Text:
    if not alerts.events:
        return Text("no job alerts", style="dim")
    text = Text()
    for i, alert in enumerate(alerts.events[:MAX_ALERTS_SHOWN]):
        if i:
            text.append("\n")
        word = SEVERITY_MEANING.get(alert.severity)
        style = meaning(app, *word) if word is not None else "dim"
        text.append(f"{alert.step:>7} ", style="dim")
        text.append(f"{alert.kind}: ", style=style)
        text.append(alert.message)
        stacks = alert.finding.stacks
        for rank in alert.ranks if not alert.cleared else []:
            stack = stacks.get(rank, "")
            if stack:
                innermost = stack.splitlines()[-1]
                text.append(f"\n        rank {rank} at {innermost}", style="dim")
    return text


class RankScreen(MonitorScreen):
    """One rank's full single-run screen inside the job; Esc goes back to the job.

    The job app keeps one, installed, and points it at each rank opened (``point_at``):
    composing and mounting its ~60 widgets again on each Enter, and laying them out afresh,
    was most of Enter's time (benchmarks/README.md, job_tui.py)."""

    BINDINGS = [Binding("escape", "back", "Job")]

    def __init__(self, rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank = rank
        self._styled_for: tuple[int, int] | None = None

    def point_at(self, rank: int) -> None:
        """Show ``rank`` from now on: nothing of the rank shown before stays (the inspect
        cursor, a charted metric, a zoomed panel, the dives followed); the view chosen (heatmap,
        sort, chart window and scales) stays, as it does between runs."""
        self.rank = rank
        if not self.is_mounted:
            return  # composed at its first push: nothing shown yet
        self._forget_run()
        if self.maximized is not None:
            self.minimize()
        self.set_class(False, "-cursor")
        self.query_one(DeepPanel).forget()
        self.query_one(ActivationTable).show(None)

    def _on_screen_resume(self, event: events.ScreenResume) -> None:
        # Textual restyles a pushed screen's whole tree (~75 ms for this one on the 2-core VM)
        # in case the theme or the stylesheet changed while it was off the stack; the app's
        # count of CSS changes (a theme or palette switch) and the stylesheet's sources say
        # whether they did. (Textual's own check, App.switch_mode, reads the same count.)
        styled = (self.app._css_update_count, len(self.app.stylesheet.source))
        if styled == self._styled_for:
            event.refresh_styles = False
        super()._on_screen_resume(event)
        self._styled_for = styled

    def action_back(self) -> None:
        self.app.pop_screen()
        closer = getattr(self.app, "close_rank", None)
        if closer is not None:  # a large job: the rank's whole stream is given back
            closer(self.rank)
