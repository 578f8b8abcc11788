"""One tab stop per panel: a widget with keys of its own takes its bordered panel's place."""

from __future__ import annotations

from textual.widget import Widget


def take_panel_tab_stop(widget: Widget) -> None:
    """Make ``widget`` its panel's only tab stop: a focusable panel around it would take one tab
    press and none of its keys (they are bound on the widget), so the panel stops taking focus;
    its border still lights up while the widget inside has it (``:focus-within``)."""
    panel = widget.parent
    if isinstance(panel, Widget) and panel.can_focus:
        panel.can_focus = False
