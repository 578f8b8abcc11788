"""The colours that carry meaning (bad, warning, good): the theme's, or colour-blind safe ones."""

from __future__ import annotations

import dataclasses
from typing import Any

from textual.theme import Theme

SUFFIX = "+colour-blind"  # the colour-blind variant of a theme is registered under this name
# Okabe & Ito's colours, told apart with every common colour-vision deficiency: the theme's
# red for "bad" and green for "good" are one colour to one man in twelve.
ERROR, WARNING, SUCCESS = "#D55E00", "#F0E442", "#56B4E9"  # vermillion, yellow, sky blue
FALLBACK = {"bad": "red", "warn": "yellow", "good": "green"}


def base_name(theme: str) -> str:
    """The theme a (possibly colour-blind) theme name was made from."""
    return theme.removesuffix(SUFFIX)


def colour_blind(theme: Theme) -> Theme:
    """``theme`` with its meaning-carrying colours (error, warning, success) replaced: every
    panel styled with $error, $warning and $success (alerts, gauges, rank states) follows."""
    return dataclasses.replace(
        theme, name=theme.name + SUFFIX, error=ERROR, warning=WARNING, success=SUCCESS
    )


def meaning(app: Any, word: str, bold: bool = False) -> str:
    """A Rich style for ``word`` (bad / warn / good) in the app's theme and palette, for the
    text drawn outside the stylesheet (tables' cells, chart markers)."""
    theme = getattr(app, "current_theme", None)
    colour = {"bad": "error", "warn": "warning", "good": "success"}[word]
    value = getattr(theme, colour, None) or FALLBACK[word]
    return f"bold {value}" if bold else str(value)


def meaning_rgb(app: Any, word: str) -> tuple[int, int, int]:
    """``meaning`` as an RGB triple (the braille chart's colours are RGB, not style strings)."""
    from textual.color import Color

    try:
        colour = Color.parse(meaning(app, word))
    except Exception:  # a theme colour Textual itself could not parse: the plain one
        colour = Color.parse(FALLBACK[word])
    return (colour.r, colour.g, colour.b)
