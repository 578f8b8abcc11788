"""A short look at a run for the picker: its step, loss, age and health, read from its history."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.markup import escape

from tdbg.connect.client import ConnectError, ProbeClient
from tdbg.connect.runtime import RunEntry
from tdbg.format import fmt, fmt_loss, fmt_span
from tdbg.model.health import Health, assess
from tdbg.model.run_state import RunState
from tdbg.protocol.framing import ProtocolError

PEEK_SECONDS = 2.0  # a run that has not sent its history by then is shown as far as it got

# The verdict's colour, as in the TUI header.
LEVEL_STYLE = {"ok": "green", "warn": "yellow", "bad": "bold red", "idle": "dim"}


@dataclass(frozen=True)
class Glance:
    """What a peek saw: the latest step, its loss, how long ago, and the health verdict."""

    step: int | None
    loss: float | None
    age: float | None  # seconds since the last step, or since the run started when none
    health: Health | None
    complete: bool  # False: the history was cut short by the deadline (an older step)
    error: str | None = None

    def markup(self) -> str:
        """One row's tail for the picker (Rich markup): ``step 1204  loss 0.4321  3s ago  ● live``;
        a step read before the deadline cut the history short is marked ``+`` (the run is
        further on)."""
        if self.error is not None:
            return f"[dim]{escape(self.error)}[/]"
        parts = []
        if self.step is not None:
            parts.append(f"step {fmt(self.step, 'd')}{'' if self.complete else '+'}")
            parts.append(f"loss {fmt_loss(self.loss)}")
        if self.age is not None:
            parts.append(f"{fmt_span(self.age)} ago" if self.step is not None else "no step yet")
        if self.health is not None:
            style = LEVEL_STYLE.get(self.health.level, "")
            parts.append(f"[{style}]● {self.health.word}[/]" if style else self.health.word)
        return "  ".join(parts)


def peek(entry: RunEntry, timeout: float = PEEK_SECONDS) -> Glance:
    """Attach to ``entry``'s socket, read its history for at most ``timeout`` seconds, detach.
    Never raises: a run that cannot be read says why in ``error``."""
    deadline = time.monotonic() + timeout
    state = RunState(dict(entry.meta))
    try:
        client = ProbeClient.connect(entry.socket, timeout=timeout)
    except (ConnectError, ProtocolError, OSError) as exc:
        return Glance(None, None, None, None, False, error=str(exc))
    try:
        state.read_history(client, deadline)
    except (ProtocolError, OSError) as exc:
        return Glance(None, None, None, None, False, error=str(exc))
    finally:
        client.close()
    now = time.time()
    step = state.last_step
    if state.n_steps:
        age: float | None = now - float(state.cols["time"].values[-1])
    else:
        started = entry.meta.get("start_time")
        age = now - float(started) if isinstance(started, int | float) else None
    return Glance(step, state.last_loss, age, assess(state, now=now), state.synced)
