"""RankTable: one row per rank of a job, worst first; Enter on a row opens that rank's screen."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widgets import DataTable

from tdbg.format import fmt_bytes, fmt_loss, fmt_us
from tdbg.tui.state.job_table import RankRow

COLUMNS = (
    "rank",
    "node",
    "step",
    "step time",
    "data wait",
    "fwd/bwd/opt",
    "loss",
    "grad norm",
    "memory",
    "alerts",
)
ALERT_STYLE = {"hang": "bold red", "rank_divergence": "bold red", "nonfinite_ranks": "bold red"}


def _time(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else fmt_us(seconds * 1e6)


class RankTable(DataTable[str | Text]):
    """Dumb view: ``show(rows)`` replaces the rows, keeping the cursor on the same rank."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for name in COLUMNS:
            self.add_column(name, key=name)

    def show(self, rows: list[RankRow]) -> None:
        keep = self.selected_rank
        self.clear()
        for row in rows:
            self.add_row(*self._cells(row), key=str(row.rank))
        if keep is not None:
            ranks = [r.rank for r in rows]
            if keep in ranks:
                self.move_cursor(row=ranks.index(keep))

    @property
    def selected_rank(self) -> int | None:
        if not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        return int(key) if key is not None else None

    @staticmethod
    def _cells(row: RankRow) -> list[str | Text]:
        phases = "/".join(
            _time(t) for t in (row.forward_time, row.backward_time, row.optimizer_time)
        )
        if row.alerts:
            alerts = Text(" ".join(row.alerts), style=ALERT_STYLE.get(row.alerts[0], "yellow"))
        elif row.state != "live":
            alerts = Text(row.state, style="dim")
        else:
            alerts = Text("ok", style="green")
        grad = row.grad_total
        return [
            str(row.rank),
            row.node,
            "-" if row.step is None else str(row.step),
            _time(row.step_time),
            _time(row.data_time),
            phases,
            fmt_loss(row.loss),
            "-" if grad is None else f"{grad:.4g}",
            "-" if row.memory is None else fmt_bytes(row.memory),
            alerts,
        ]
