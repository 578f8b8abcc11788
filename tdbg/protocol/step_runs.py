"""Runs of a stream's step batches joined into one batch each (fewer, larger folds)."""

from __future__ import annotations

from typing import Any

from tdbg.protocol.steps import concat_steps, joinable


def coalesced(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` in order, each run of consecutive step batches that can be joined byte-wise
    (same layers, learning-rate groups and history flag) joined into one; a malformed batch is
    passed on as it came (RunState.apply judges it)."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []

    def flush() -> None:
        try:
            joined = concat_steps(run) if len(run) > 1 else None
        except (KeyError, TypeError, ValueError):
            joined = None
        out.extend([joined] if joined is not None else run)
        run.clear()

    for message in messages:
        if message.get("type") != "steps":
            flush()
            out.append(message)
            continue
        try:
            fits = not run or (
                joinable(run[0], message) and run[0].get("history") == message.get("history")
            )
        except KeyError:
            fits = False
        if not fits:
            flush()
        run.append(message)
    flush()
    return out


__all__ = ["coalesced"]
