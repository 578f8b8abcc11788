"""Fit a line of parts to a width by leaving out the least important parts, not cutting the end."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

# A part's rank: 0 always stays; higher ranks go first when the line is too long.
Part = tuple[Text | str, int]


def fit_parts(parts: Sequence[Part], width: int, style: str = "") -> Text:
    """``parts`` joined in order (each carries its own leading separator), the highest-ranked
    left out one by one until the line fits ``width`` cells; what still does not fit is cut
    with an ellipsis (only the rank-0 parts are left by then)."""
    kept = [(Text(p, style=style) if isinstance(p, str) else p, rank) for p, rank in parts]
    total = sum(text.cell_len for text, _ in kept)
    while total > width:
        worst = max(range(len(kept)), key=lambda i: (kept[i][1], i), default=None)
        if worst is None or kept[worst][1] == 0:
            break
        total -= kept[worst][0].cell_len
        del kept[worst]
    line = Text(no_wrap=True, overflow="ellipsis", end="")
    for text, _ in kept:
        line.append_text(text)
    line.truncate(max(1, width), overflow="ellipsis")
    return line
