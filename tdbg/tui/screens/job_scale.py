"""ScaleJobScreen: a large job from its nodes' summaries — the spread of step time, loss and
gradient norm with the outliers named, the worst ranks, the nodes worst first, which rank was the
slowest over time, the job alerts; Enter on a node shows its ranks, Enter on a rank opens its
full screen (RankScreen)."""

from __future__ import annotations

import math
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import DataTable, Static

from tdbg.format import fmt_loss, fmt_us
from tdbg.model.job_alerts import JobAlerts
from tdbg.model.job_nodes import NodesJob
from tdbg.model.job_scale import NodeRow, Spread, node_rows, spreads, worst_rows
from tdbg.tui.screens.job import alert_text, judged_words, slowest_text
from tdbg.tui.widgets.rank_table import RankTable
from tdbg.tui.widgets.steady_footer import SteadyFooter

NODE_COLUMNS = ("node", "ranks", "steps", "step time", "slowest rank", "trouble")


def _value(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    return fmt_us(value * 1e6) if unit == "s" else fmt_loss(value)


class NodeTable(DataTable[Text]):
    """Dumb view: one row per node, worst first; Enter asks to show that node's ranks."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self._shown: list[list[Text]] = []
        self._order: list[str] = []
        for name in NODE_COLUMNS:
            self.add_column(name, key=name)

    def show(self, rows: list[NodeRow]) -> None:
        """Rows in the same order as last time get only their changed cells rewritten (128
        nodes cleared and re-added cost ~30 ms a frame)."""
        cells = [self._cells(r) for r in rows]
        order = [r.node for r in rows]
        if order == self._order:
            for node, old, new in zip(order, self._shown, cells, strict=True):
                for column, before, after in zip(NODE_COLUMNS, old, new, strict=True):
                    if before != after:
                        self.update_cell(node, column, after)
            self._shown = cells
            return
        # The cursor follows its node to its new row, unless it is on the top row: there it
        # stays on the worst node. (Followed from the start, it kept whichever node's summary
        # came first and scrolled the worst nodes out of sight as the others arrived.)
        keep = self.selected_node if self.cursor_row > 0 else None
        self.clear()
        for row, row_cells in zip(rows, cells, strict=True):
            self.add_row(*row_cells, key=row.node)
        self._shown, self._order = cells, order
        if keep in order:
            self.move_cursor(row=order.index(keep))

    @property
    def selected_node(self) -> str | None:
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        return None if key is None else str(key)

    @staticmethod
    def _cells(row: NodeRow) -> list[Text]:
        steps = "-" if row.step_lo is None else f"{row.step_lo}-{row.step_hi}"
        if row.step_lo == row.step_hi and row.step_lo is not None:
            steps = str(row.step_lo)
        slowest = "-"
        if row.slowest is not None:
            slowest = f"{row.slowest[0]} ({_value(row.slowest[1], 's')})"
        if row.lost:
            trouble = Text(f"not read: {row.lost}", style="bold red")
        elif row.trouble:
            trouble = Text(f"{row.trouble} rank{'s' if row.trouble > 1 else ''}", style="yellow")
        else:
            trouble = Text("ok", style="green")
        time_ = "-" if row.step_time is None else _value(row.step_time, "s")
        return [Text(row.node), Text(str(row.ranks)), Text(steps), Text(time_),
                Text(slowest), trouble]  # fmt: skip


class ScaleJobScreen(Screen[None]):
    """Dumb view: ``show(nodes, alerts)`` repaints; Enter on a rank asks the app to open it."""

    BINDINGS = [
        Binding("enter", "open", "Open", show=True),
        Binding("escape", "all_nodes", "All nodes", show=False),
    ]
    DEFAULT_CSS = """
    ScaleJobScreen #job-spread { height: auto; border: round $primary; }
    ScaleJobScreen #job-worst { height: 2fr; min-height: 4; border: round $primary; }
    ScaleJobScreen #worst-table { height: 1fr; }
    ScaleJobScreen #job-node-list { height: 1fr; min-height: 4; border: round $primary; }
    ScaleJobScreen #node-table { height: 1fr; }
    ScaleJobScreen #job-bottom { height: 1fr; min-height: 3; }
    ScaleJobScreen #job-slowest { width: 1fr; border: round $primary; }
    ScaleJobScreen #job-alerts { width: 1fr; height: 1fr; min-height: 3; border: round $primary; }
    ScaleJobScreen #job-rule { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    ScaleJobScreen #job-line { text-style: bold; }
    ScaleJobScreen #job-nodes { color: $warning; display: none; }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.node: str | None = None  # the node whose ranks the worst table shows (Enter)

    def compose(self) -> ComposeResult:
        yield Static(id="job-line")
        yield Static(id="job-nodes")
        yield Static(id="job-rule")
        with Vertical(id="job-spread", classes="panel"):
            yield Static(id="job-spread-text")
        with Vertical(id="job-worst", classes="panel"):
            yield RankTable(id="worst-table")
        with Vertical(id="job-node-list", classes="panel"):
            yield NodeTable(id="node-table")
        # Side by side: a fourth panel in a row of its own does not fit 80x24.
        with Horizontal(id="job-bottom"):
            with Vertical(id="job-alerts", classes="panel"):
                yield Static("no job alerts", id="job-alert-list")
            with Vertical(id="job-slowest", classes="panel"):
                yield Static(id="job-slowest-list")
        yield SteadyFooter()  # not rebuilt on each return from a rank or the help

    def on_mount(self) -> None:
        self.query_one("#job-spread").border_title = "Across the ranks (! outliers)"
        self.query_one("#job-node-list").border_title = "Nodes (worst first; Enter: its ranks)"
        self.query_one("#job-slowest").border_title = "Slowest rank over time"
        self.query_one("#job-alerts").border_title = "Job alerts"
        self._title_worst(0)
        self.show_nodes(getattr(self.app, "node_lines", []))

    def _title_worst(self, total: int) -> None:
        where = f"node {self.node}'s ranks" if self.node else f"worst ranks of {total}"
        back = "; Esc: all nodes" if self.node else ""
        self.query_one("#job-worst").border_title = f"{where.capitalize()} (Enter opens one{back})"

    def show_nodes(self, lines: list[str]) -> None:
        line = self.query_one("#job-nodes", Static)
        line.update(Text("\n".join(f"! {text}" for text in lines)))
        line.display = bool(lines)

    def show(self, nodes: NodesJob, alerts: JobAlerts) -> bool:
        if not self.is_mounted or not self.query(SteadyFooter):
            return False
        try:
            self.query_one("#job-line", Static).update(_job_line(nodes))
            self.query_one("#job-rule", Static).update(Text(f"divergence check {alerts.rule}"))
            spread = spreads(nodes)
            self.query_one("#job-spread-text", Static).update(_spread_text(spread))
            self._title_worst(len(nodes.figures))
            self.query_one(RankTable).show(worst_rows(nodes, alerts, self.node, spread_=spread))
            self.query_one(NodeTable).show(node_rows(nodes, alerts))
            self.query_one("#job-slowest-list", Static).update(slowest_text(alerts.history))
            self.query_one("#job-slowest").border_subtitle = judged_words(alerts.history)
            self.query_one("#job-alert-list", Static).update(alert_text(alerts, self.app))
        except NoMatches:
            return False
        return True

    def action_open(self) -> None:
        """Enter: on a rank, its full screen; on a node, its ranks in the worst table."""
        focused = self.focused
        if isinstance(focused, NodeTable):
            self._open_node(focused.selected_node)
            return
        rank = self.query_one(RankTable).selected_rank
        opener = getattr(self.app, "open_rank", None)
        if rank is not None and opener is not None:
            opener(rank)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The cursor's rank and row in the worst table's bottom edge (which rank Enter opens)."""
        if not isinstance(event.data_table, RankTable):
            return
        rank = event.data_table.selected_rank
        where = f"rank {rank} · row {event.cursor_row + 1} of {event.data_table.row_count}"
        self.query_one("#job-worst").border_subtitle = "" if rank is None else where

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if isinstance(event.data_table, NodeTable):
            self._open_node(event.data_table.selected_node)
        elif event.row_key.value is not None:
            opener = getattr(self.app, "open_rank", None)
            if opener is not None:
                opener(int(event.row_key.value))

    def _open_node(self, node: str | None) -> None:
        self.node = node
        self.query_one(RankTable).focus()
        self._repaint_now()

    def action_all_nodes(self) -> None:
        if self.node is not None:
            self.node = None
            self._repaint_now()

    def _repaint_now(self) -> None:
        repaint = getattr(self.app, "repaint_job", None)
        if repaint is not None:
            repaint()


def _job_line(nodes: NodesJob) -> Text:
    text = Text()
    text.append(f"job {nodes.job}", style="bold")
    text.append(f"  {len(nodes.figures)} of {nodes.world_size} ranks on {len(nodes.nodes)} nodes")
    missing = nodes.missing_ranks()
    if missing:
        text.append(f" (missing {', '.join(map(str, missing[:8]))})", style="yellow")
    steps = nodes.rank_steps()
    if steps:
        lo, hi = min(steps), max(steps)
        text.append(f"  step {lo}" + (f"-{hi}" if hi != lo else ""))
    losses = [x for f in nodes.figures.values() if (x := f.loss) is not None and math.isfinite(x)]
    if losses:
        text.append(f"  loss {fmt_loss(sum(losses) / len(losses))} (mean of ranks)")
    newest = max((s.time for s in nodes.nodes.values()), default=None)
    if newest is not None and time.time() - newest > 5:
        text.append(f"  summaries {time.time() - newest:.0f} s old", style="yellow")
    return text


def _spread_text(rows: list[Spread]) -> Text:
    text = Text()
    for i, s in enumerate(rows):
        if i:
            text.append("\n")
        text.append(f"{s.name:<10}", style="bold")
        if s.quantiles is None:
            text.append("-", style="dim")
            continue
        lo, q1, mid, q3, hi = (_value(v, s.unit) for v in s.quantiles)
        text.append(f" median {mid}  p25-p75 {q1}-{q3}  min {lo} max {hi}")
        named = [f"rank {r} {_value(v, s.unit)}" for r, v in s.outliers[:3]]
        named += [f"rank {r} non-finite" for r in s.nonfinite[:3]]
        more = len(s.outliers) + len(s.nonfinite) - len(named)
        if named:
            text.append("  ! ", style="yellow")
            text.append(", ".join(named) + (f" (+{more})" if more > 0 else ""), style="yellow")
    return text
