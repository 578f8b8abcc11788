"""Layer names for narrow columns: shortened from the middle, and matched by a typed filter."""

from __future__ import annotations

from collections.abc import Sequence

ELLIPSIS = "…"
MIN_ROOT = 3  # fewer first letters of a root than this say nothing ("t…")


def shorten(name: str, width: int) -> str:
    """``name`` in at most ``width`` cells, cut from the middle so the tail survives.

    Dotted components are kept in this order while they fit: the last one (``weight``), every
    one with a digit (the index that tells ``layers.3`` from ``layers.4``), the trailing ones
    from the right until one does not fit, the first one (the model's root). Each run of dropped
    components reads ``…``; a root that did not fit whole gives its first letters (at least
    MIN_ROOT) to the room left. Only a name of one long component is cut inside a component:
    a piece of a number would misread (``1`` of ``10``). So
    ``transformer.h.1.attn.c_proj.weight`` in 20 cells is ``tran…1…c_proj.weight``.
    """
    if len(name) <= width:
        return name
    if width <= 1:
        return ELLIPSIS[:width]
    parts = name.split(".")
    last = len(parts) - 1
    if last == 0 or len(parts[last]) + 1 > width:  # one long component: its two ends
        head = (width - 1) // 3 if last == 0 else 0
        return name[:head] + ELLIPSIS + name[len(name) - (width - 1 - head) :]
    kept = {last}
    numbered = [i for i in range(last - 1, 0, -1) if any(c.isdigit() for c in parts[i])]
    for i in numbered:
        if len(_render(parts, kept | {i})) <= width:
            kept.add(i)
    for i in range(last - 1, 0, -1):
        if i in kept:
            continue
        if len(_render(parts, kept | {i})) > width:
            break
        kept.add(i)
    if len(_render(parts, kept | {0})) <= width:
        kept.add(0)
    short = _render(parts, kept)
    root = parts[0]
    room = width - len(short)
    if 0 not in kept and room >= MIN_ROOT and not any(c.isdigit() for c in root):
        short = root[:room] + short
    return short


def _render(parts: list[str], kept: set[int]) -> str:
    """The kept components in order, ``.`` between neighbours, ``…`` for each run dropped."""
    out: list[str] = []
    for i, part in enumerate(parts):
        if i in kept:
            if out and out[-1] != ELLIPSIS:
                out.append(".")
            out.append(part)
        elif not out or out[-1] != ELLIPSIS:
            out.append(ELLIPSIS)
    return "".join(out)


def matching(names: Sequence[str], query: str) -> list[int]:
    """Indices of the names that contain every whitespace-separated term of ``query``
    (case-insensitive): ``attn 1.`` finds ``blocks.1.attn.weight``. An empty query keeps all."""
    terms = query.lower().split()
    if not terms:
        return list(range(len(names)))
    return [i for i, name in enumerate(names) if all(t in name.lower() for t in terms)]
