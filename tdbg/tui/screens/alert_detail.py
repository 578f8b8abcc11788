"""AlertDetailScreen: one alert in full (message, step, kind, layers, stack, collective)."""

from __future__ import annotations

import time

from rich.text import Text

from tdbg.model.alert_view import AlertRow
from tdbg.tui.screens.text_box import TextBoxScreen


def describe(row: AlertRow) -> Text:
    """The alert under ``row`` as text: every field the probe sent, none cut short."""
    alert = row.alert
    text = Text()

    def field(name: str, value: str) -> None:
        text.append(f"{name:<11}", "bold")
        text.append(value + "\n")

    field("kind", f"{alert.kind} ({alert.severity})")
    step = "unknown" if alert.step is None else str(alert.step)
    field("step", step)
    if row.count > 1:
        first = "?" if row.first_step is None else str(row.first_step)
        last = "?" if row.last_step is None else str(row.last_step)
        which = "of this kind" if row.pinned else "with this message"
        field("seen", f"{row.count} times {which}, steps {first} to {last}")
    if row.pinned:
        field("order", "the first alert of its kind")
    if alert.time is not None:
        field("time", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(alert.time)))
    if alert.history:
        field("sent", "from the probe's history, before this client attached")
    text.append("\nmessage\n", "bold")
    text.append(f"  {alert.message or '(none)'}\n")
    if alert.layers:
        text.append(f"\nlayers ({len(alert.layers)})\n", "bold")
        for layer in alert.layers:
            text.append(f"  {layer}\n")
    if alert.stack:
        text.append("\nstack of the training thread (innermost last)\n", "bold")
        for frame in alert.stack:
            text.append(f"  {frame}\n")
    if alert.collective:
        text.append("\nlast collective of this rank\n", "bold")
        for key, value in alert.collective.items():
            text.append(f"  {key}: {value}\n")
    text.rstrip()
    return text


class AlertDetailScreen(TextBoxScreen):
    """One alert in full."""

    def __init__(self, row: AlertRow) -> None:
        super().__init__(f"alert: {row.alert.kind}", describe(row))
        self.row = row
