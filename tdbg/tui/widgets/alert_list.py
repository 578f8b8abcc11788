"""AlertList: the probe's alerts, newest first, coloured by severity, with step and layers."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from tdbg.tui.state.run_state import RunState

MAX_SHOWN = 200  # the model keeps more; a panel this size never shows more than a screenful


class AlertList(Static):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "alert-list--error",
        "alert-list--warning",
        "alert-list--info",
        "alert-list--dim",
    }

    def show(self, state: RunState) -> None:
        if not state.alerts:
            self.update("no alerts")
            return
        text = Text()
        dim = self.get_component_rich_style("alert-list--dim")
        for i, alert in enumerate(list(state.alerts)[:MAX_SHOWN]):
            if i:
                text.append("\n")
            severity = alert.severity if alert.severity in ("error", "warning") else "info"
            style = self.get_component_rich_style(f"alert-list--{severity}")
            step = "?" if alert.step is None else str(alert.step)
            text.append(f"{severity[0].upper()} ", style)
            text.append(f"{step:>6} ", dim)
            text.append(f"{alert.kind}: ", style)
            text.append(alert.message)
            if alert.layers:
                shown = ", ".join(alert.layers[:3])
                more = f" +{len(alert.layers) - 3}" if len(alert.layers) > 3 else ""
                text.append(f" [{shown}{more}]", dim)
        self.update(text)
