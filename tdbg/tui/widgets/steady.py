"""Repaint only what changed: a Static that skips unchanged content; borders, classes set once."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.dom import DOMNode
from textual.geometry import Region
from textual.visual import VisualType
from textual.widget import Widget
from textual.widgets import Static


def _key(content: object) -> object:
    """What decides whether two contents draw the same; None when that cannot be told cheaply.

    rich's Text equality ignores the base style, so a verdict that turns from green to red with
    the same words would compare equal: the key includes it."""
    if isinstance(content, str):
        return content
    if isinstance(content, Text):
        return (content.plain, tuple(content.spans), str(content.style), content.justify)
    return None


def _unwrapped_lines(content: object) -> int | None:
    """How many lines ``content`` draws whatever the width (a Text that never wraps); None when
    that depends on the width or cannot be told cheaply."""
    if isinstance(content, Text) and content.no_wrap:
        return content.plain.count("\n") + 1
    return None


class SteadyStatic(Static):
    """``update()`` with unchanged content does nothing: no re-render, no layout pass. A
    Textual Static re-renders (and by default lays the screen out again) on every update, which
    was most of the app's idle CPU with data arriving. Changed content is laid out again only
    when it can change the widget's size: a widget sized by its CSS, or a Text that never wraps
    drawing as many lines as before in a widget whose width is not its content's, is repainted
    alone (a layout pass of the whole screen was half the TUI's CPU with data arriving:
    benchmarks/README.md, tui.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steady_key: object = None
        self._steady_lines: int | None = None

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        key = _key(content)
        if key is not None and key == self._steady_key:
            return
        self._steady_key = key
        lines = _unwrapped_lines(content)
        if layout and self.is_mounted:
            styles = self.styles
            # No width set: the widget fills its container, whatever it shows.
            width_auto = styles.width is not None and styles.width.is_auto
            height_auto = styles.height is None or styles.height.is_auto
            same_height = not height_auto or (lines is not None and lines == self._steady_lines)
            layout = width_auto or not same_height
        self._steady_lines = lines
        super().update(content, layout=layout)


def set_border(widget: Widget, *, title: str | None = None, subtitle: str | None = None) -> None:
    """Set a panel's border title and subtitle, leaving each alone when it would not change:
    Textual repaints the panel on every set, and a repainted container redraws all it holds
    (the gradient panel's frame was set the same subtitle four times a second)."""
    if title is not None and widget.border_title != title:
        _set_border_row(widget, "_border_title", title, top=True)
    if subtitle is not None and widget.border_subtitle != subtitle:
        _set_border_row(widget, "_border_subtitle", subtitle, top=False)


def _set_border_row(widget: Widget, attribute: str, text: str, *, top: bool) -> None:
    """What Textual's ``border_title`` / ``border_subtitle`` setters do, but repainting the one
    border row the text is drawn on rather than the whole widget: a loss or gradient panel whose
    subtitle says the latest values re-rendered every line of its frame at each paint (~16 lines
    twice a second, each through the border and background code) and made the screen's dirty
    region span the panel."""
    outer = widget.outer_size
    if not widget.is_mounted or not outer:
        setattr(widget, attribute.removeprefix("_"), text)  # the setter: a full repaint
        return
    # As the setter stores it (markup rendered, tabs expanded, one line).
    setattr(widget, attribute, widget.render_str(text).expand_tabs(4).split()[0])
    # refresh() takes regions in content coordinates: the border row is above or below them.
    left, above = widget.content_offset
    row = 0 if top else outer.height - 1
    widget.refresh(Region(-left, row - above, outer.width, 1))


def set_classes(node: DOMNode, wanted: dict[str, bool]) -> None:
    """Add or remove several CSS classes with one restyle: Textual restyles a node and all it
    holds at once on each class change (~20 ms for the monitor screen), so the screen's seven
    size classes cost seven restyles at start and on each resize."""
    changed = False
    for name, on in wanted.items():
        if node.has_class(name) != on:
            node.set_class(on, name, update=False)
            changed = True
    if changed:
        node.update_node_styles()
