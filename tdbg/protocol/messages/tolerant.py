"""Tolerant readers of wire figures: a malformed value reads as None (or empty), never raises."""

from __future__ import annotations

import math
from typing import Any

# A client (the TUI, ``tdbg dump``, the CLI's reports) reads what a probe sent through the
# messages' ``from_wire``, never through raw keys. They never raise: a hostile or buggy probe's
# malformed figure reads as None (not measured), a malformed list entry is dropped, so nothing
# downstream needs to defend itself again. These are the figures' readers they share.


def as_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value)


def as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def as_steps(value: Any) -> tuple[int, int] | None:
    """A ``[first, last]`` pair of steps; None when either is not a step number."""
    pair = [as_int(v) for v in as_list(value)]
    if len(pair) != 2 or pair[0] is None or pair[1] is None:
        return None
    return (pair[0], pair[1])


def steps_to_wire(steps: tuple[int, int] | None) -> list[int]:
    """A ``[first, last]`` pair as sent: ``[]`` when unknown."""
    return [] if steps is None else [steps[0], steps[1]]
