"""AlertList: the alerts, root cause first (the first of each kind), repeats folded; keys scroll
and enter asks for one alert in full (``AlertChosen``; the screen opens it)."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from tdbg.model.alert_view import AlertDigest, AlertRow
from tdbg.model.run_state import RunState
from tdbg.tui.widgets.tab_stop import take_panel_tab_stop

LATER = "later"  # the separator's id: the rows below it came after the first of their kind


class AlertList(OptionList):
    """Call ``show(state)``; it redraws only when an alert arrived. Its keys (OptionList's):
    ↑ ↓ PgUp PgDn Home End move the cursor, enter posts ``AlertChosen`` for the alert under it
    (a widget posts, its screen pushes the detail screen)."""

    class AlertChosen(Message):
        """The user chose an alert to read in full."""

        def __init__(self, row: AlertRow) -> None:
            super().__init__()
            self.row = row

    COMPONENT_CLASSES: ClassVar[set[str]] = OptionList.COMPONENT_CLASSES | {
        "alert-list--error",
        "alert-list--warning",
        "alert-list--info",
        "alert-list--dim",
    }
    DEFAULT_CSS = """
    AlertList {
        height: 1fr;
        max-height: 100%;
        border: none;
        padding: 0;
        background: transparent;
    }
    AlertList:focus { border: none; background-tint: $foreground 5%; }
    AlertList > .option-list--option { padding: 0; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.digest = AlertDigest()
        self._rows: dict[str, AlertRow] = {}
        self._shown = -1

    def on_mount(self) -> None:
        take_panel_tab_stop(self)

    def show(self, state: RunState) -> None:
        self.digest.update(state.alerts, state.alert_count)
        if self.digest.revision != self._shown:
            self._rebuild()

    def on_resize(self) -> None:
        self._rebuild()  # each row is cut to the width, so that it takes one line

    def _rebuild(self) -> None:
        self._shown = self.digest.revision
        rows = self.digest.rows()
        self._rows = {row.key: row for row in rows}
        highlighted = self.highlighted_option
        keep = highlighted.id if highlighted is not None else None
        scroll = self.scroll_y
        options: list[Option | None] = [
            Option(self._prompt(r), id=r.key) for r in self.digest.pinned
        ]
        later = self.digest.later
        if later:
            options.append(
                Option(Text("── later, newest first ──", style="dim"), id=LATER, disabled=True)
            )
            options.extend(Option(self._prompt(r), id=r.key) for r in later)
        if self.digest.missed:  # so a pinned row is not taken for the run's very first
            missed = f"{self.digest.missed} earlier alerts arrived too fast to be kept"
            options.append(Option(Text(missed, style="dim"), disabled=True))
        if not rows:
            options.append(Option("no alerts", disabled=True))
        with self.app.batch_update():
            self.set_options(options)
            if keep in self._rows:
                self.highlighted = self.get_option_index(keep)
            elif rows:
                self.highlighted = 0
            self.scroll_to(y=scroll, animate=False, immediate=True)

    def _prompt(self, row: AlertRow) -> Text:
        alert = row.alert
        severity = alert.severity if alert.severity in ("error", "warning") else "info"
        style = self.get_component_rich_style(f"alert-list--{severity}", partial=True)
        dim = self.get_component_rich_style("alert-list--dim", partial=True)
        step = "?" if row.first_step is None else str(row.first_step)
        if row.count > 1 and row.last_step != row.first_step:
            step += "–" + ("?" if row.last_step is None else str(row.last_step))
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        text.append(f"{severity[0].upper()} ", style)
        text.append(f"{step:>5} ", dim)
        if row.count > 1:  # before the kind: a narrow panel cuts the end of the line
            text.append(f"×{row.count} ", style)
        text.append(alert.kind, style)
        text.append(": ", style)
        text.append(alert.message)
        if alert.layers:
            shown = ", ".join(alert.layers[:3])
            more = f" +{len(alert.layers) - 3}" if len(alert.layers) > 3 else ""
            text.append(f" [{shown}{more}]", dim)
        text.truncate(max(8, self.scrollable_content_region.width), overflow="ellipsis")
        return text

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        row = self._rows.get(event.option_id or "")
        if row is not None:
            self.post_message(self.AlertChosen(row))
