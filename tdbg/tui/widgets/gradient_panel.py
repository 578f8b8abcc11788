"""GradientPanel: the gradient table or heatmap, with its keys: `/` filter, `t` trend scale."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Input

from tdbg.tui.widgets.fit import Part, fit_parts
from tdbg.tui.widgets.gradient_heatmap import GradientHeatmap
from tdbg.tui.widgets.gradient_table import GradientTable
from tdbg.tui.widgets.steady import SteadyStatic, set_border


class GradientPanel(Vertical):
    """The summary line, the filter (shown on ``/``), and the table / heatmap switcher.

    It sits in the monitor's bordered frame and writes that frame's title and subtitle, so what
    it adds (the filter and its count, the trend scale) is there the moment a key changes it;
    the monitor hands it its own parts with :meth:`set_title` and :meth:`set_subtitle`.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter layers", show=False),
        Binding("t", "trend_scale", "Trend scale", show=False),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]
    DEFAULT_CSS = """
    GradientPanel { height: 1fr; }
    GradientPanel > #grad-filter { display: none; margin: 0 1; }
    GradientPanel.-filtering > #grad-filter { display: block; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._title = ""
        self._subtitle: list[Part] = []

    def compose(self) -> ComposeResult:
        yield SteadyStatic(id="grad-summary")
        yield Input(
            placeholder="filter layers by name (enter: keep, escape: clear)",
            compact=True,
            id="grad-filter",
        )
        with ContentSwitcher(initial="grad-table", id="grad-switcher"):
            yield GradientTable(id="grad-table")
            yield GradientHeatmap(id="grad-heatmap")

    # --- the frame's title and subtitle ---------------------------------------------------

    def set_title(self, title: str) -> None:
        self._title = title
        self._write_headings()

    def set_subtitle(self, subtitle: list[Part]) -> None:
        """The frame's bottom line as ranked parts (see fit_parts): fitted to the frame."""
        self._subtitle = subtitle
        self._write_headings()

    def on_gradient_table_columns_changed(self, event: GradientTable.ColumnsChanged) -> None:
        event.stop()
        self._write_headings()

    def on_resize(self) -> None:
        self.call_after_refresh(self._write_headings)  # once the frame has its new width

    def _view(self) -> GradientTable | GradientHeatmap:
        switcher = self.query_one(ContentSwitcher)
        if switcher.current == "grad-heatmap":
            return self.query_one(GradientHeatmap)
        return self.query_one(GradientTable)

    def _write_headings(self) -> None:
        frame = self.parent
        if not isinstance(frame, Widget):
            return
        title = self._title
        query = self.query_one(GradientTable).name_filter
        if query:  # first: a long title is cut at its end
            view = self._view()
            title = f"filter: {query} ({view.matched} of {view.total}) · {title}"
        set_border(frame, title=title)
        subtitle = list(self._subtitle)
        table = self.query_one(GradientTable)
        if isinstance(self._view(), GradientTable) and table.shows_trend:
            shared = table.shared_trend
            subtitle.append((" · trend: all (t)" if shared else " · trend: row (t)", 1))
        line = fit_parts(subtitle, max(1, frame.outer_size.width - 6))  # less corners, dashes
        set_border(frame, subtitle=line.plain.removeprefix(" · "))

    # --- keys -----------------------------------------------------------------------------

    def action_filter(self) -> None:
        self.add_class("-filtering")
        self.query_one("#grad-filter", Input).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "clear_filter":
            # Escape is the screen's too (un-zoom): take it only while there is a filter.
            return self.has_class("-filtering") or bool(self.query_one(GradientTable).name_filter)
        return True

    def action_clear_filter(self) -> None:
        self.query_one("#grad-filter", Input).value = ""
        self._apply_filter("")
        self.remove_class("-filtering")
        self._view().focus()

    def action_trend_scale(self) -> None:
        shared = self.query_one(GradientTable).toggle_shared_trend()
        self._write_headings()
        which = "one scale for all rows" if shared else "each row on its own scale"
        self.notify(f"gradient trends: {which}", timeout=2)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._apply_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter keeps the filter and hands the keys back to the layers."""
        event.stop()
        if not event.value.strip():
            self.remove_class("-filtering")
        self._view().focus()

    def _apply_filter(self, query: str) -> None:
        query = query.strip()
        self.query_one(GradientTable).filter(query)
        self.query_one(GradientHeatmap).filter(query)
        self._write_headings()
