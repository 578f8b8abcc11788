"""A Static that repaints only when what it shows changed (most panels are rewritten each frame)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.visual import VisualType
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


class SteadyStatic(Static):
    """``update()`` with unchanged content does nothing: no re-render, no layout pass. A
    Textual Static re-renders (and by default lays the screen out again) on every update, which
    was most of the app's idle CPU with data arriving."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steady_key: object = None

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        key = _key(content)
        if key is not None and key == self._steady_key:
            return
        self._steady_key = key
        super().update(content, layout=layout)
